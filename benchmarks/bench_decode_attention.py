"""Decode steps with the C attention kernel against torch's, side by side in one process.

A batch of 8 sequences of 1,500-2,300 prompt tokens (about what bench_pd's decode worker
steps in its last rounds), ``small`` model, one thread, as a decode worker runs it. Each
round times ``--steps`` steps of the whole model (``Model.decode_step``) with one kernel,
then the other, alternating, so a shared machine's drift falls on both; and, apart, a
layer's attention for the batch (the part the kernel replaces). Medians of ``--rounds``.

Writes benchmarks/results/decode_attention.json: ``step_ms`` and ``attention_ms`` per kernel
(thread CPU per step / per layer call), ``step_ratio`` and ``attention_ratio`` (C over
torch; below 1 is faster), and the largest difference of the logits between the two.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.core.config import ModelConfig
from pd_cache.model import native
from pd_cache.model.layers import attend_step
from pd_cache.model.model import Model

SEED = 1234
RESULTS = Path(__file__).parent / "results" / "decode_attention.json"


def timed(fn: Callable[[], object], n: int) -> float:
    """Thread CPU ms per call of ``fn`` over ``n`` calls."""
    start = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    if native.kernel() is None:
        raise SystemExit("the C kernel is not built or does not serve on this CPU "
                         "(pd_cache/model/native.py)")
    torch.set_num_threads(1)
    model = Model(ModelConfig.preset("small"))
    cfg = model.cfg
    g = torch.Generator().manual_seed(SEED)
    lens = torch.randint(1500, 2301, (args.batch,), generator=g).tolist()
    # NOTE: the KV of random prompts, as a decode buffer holds it after the join; the
    # kernels read it, whatever it is, the same way
    bufs = [torch.randn(2, cfg.num_layers, n + args.steps + 1, cfg.num_kv_heads, cfg.head_dim,
                        generator=g) for n in lens]
    tokens = torch.randint(0, cfg.vocab_size, (args.batch,), generator=g).tolist()
    q = torch.randn(args.batch, cfg.num_heads, cfg.head_dim, generator=g)
    new = torch.randn(args.batch, 2, cfg.num_kv_heads, cfg.head_dim, generator=g)
    fast_kernel = native.kernel()
    kernels = {"c": lambda: fast_kernel, "torch": lambda: None}
    figures: dict[str, dict[str, list[float]]] = {k: {"step": [], "attention": []}
                                                   for k in kernels}
    logits = {}
    for _ in range(args.rounds):
        for name, pick in kernels.items():
            native.kernel = pick   # NOTE: this process only; the module reads it per call
            figures[name]["step"].append(timed(
                lambda: model.decode_step(tokens, bufs, lens), args.steps))
            figures[name]["attention"].append(timed(
                lambda: attend_step(q, new, bufs, 1, lens), args.steps * cfg.num_layers))
            logits[name] = model.decode_step(tokens, bufs, lens)
    step = {k: statistics.median(v["step"]) for k, v in figures.items()}
    attention = {k: statistics.median(v["attention"]) for k, v in figures.items()}
    diff = float((logits["c"] - logits["torch"]).abs().max())
    out = {
        "benchmark": "decode_attention", "seed": SEED, "model": cfg.name,
        "batch": args.batch, "prompt_tokens": lens, "rounds": args.rounds,
        "steps": args.steps, "machine": {"cpus": os.cpu_count(),
                                          "python": platform.python_version()},
        "load_average": os.getloadavg(),
        "runs_ms": figures, "step_ms": step, "attention_ms": attention,
        "step_ratio": step["c"] / step["torch"],
        "attention_ratio": attention["c"] / attention["torch"],
        "logits_max_difference": diff,
        "same_tokens": logits["c"].argmax(-1).tolist() == logits["torch"].argmax(-1).tolist(),
    }
    print(f"decode step, batch {args.batch} at {min(lens)}-{max(lens)} tokens: C "
          f"{step['c']:.2f} ms vs torch {step['torch']:.2f} ms ({out['step_ratio']:.2f}x); "
          f"a layer's attention {attention['c']:.2f} vs {attention['torch']:.2f} ms "
          f"({out['attention_ratio']:.2f}x); logits differ by at most {diff:.1e}, same "
          f"tokens: {out['same_tokens']}")
    write_result(RESULTS, out)


if __name__ == "__main__":
    main()
