"""Time to first token of a Hugging Face checkpoint: cold vs cached (L1 hit, L3 prefetch).

Builds a tiny random Llama checkpoint (``pd-cache make-checkpoint``'s builder: 4 layers,
hidden 256, 8 query / 2 KV heads, fixed seed) in a temporary directory, serves it from
``--model DIR`` exactly as a real one (``ModelConfig.from_pretrained``, safetensors weights,
``HFModel``), and times ``engine.prefill`` of a 2048-token prompt, three cases side by side
in each repetition, each in a fresh namespace:
  cold    nothing cached: the whole prompt is computed
  device  the first 1920 tokens (120 pages) cached by an earlier request (L1 hit)
  l3      the same pages written through to an in-process L3 by one engine and
          prefetched by a second, fresh engine (L3 -> host -> device)
The headline uses each case's fastest run (medians and samples are in the JSON). Needs
the ``hf`` extra.

    python benchmarks/bench_hf.py [--repeats R] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache import CacheConfig, LocalEngine, ModelConfig, PDCacheConfig, Req
from pd_cache.app.tiny_checkpoint import make_tiny_checkpoint
from pd_cache.storage import make_backend

RESULTS = Path(__file__).parent / "results" / "hf.json"
SEED = 1234
PROMPT, CACHED, PAGE = 2048, 1920, 16
SHAPE = dict(arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             max_context=4096, rope_theta=500000.0)


def timed_prefill(engine: LocalEngine, req: Req) -> tuple[float, dict[str, int], int]:
    start = time.perf_counter()
    out = engine.prefill(req)
    return time.perf_counter() - start, out.cached_tokens, out.first_token


def one_round(writer: LocalEngine, reader: LocalEngine, prompt: list[int],
              rep: int) -> dict[str, float]:
    """Cold, L1-hit and L3-hit TTFT of ``prompt``, each in its own namespace; ``reader``
    has never seen that namespace, so its hit comes from L3."""
    times, firsts = {}, set()
    cases = (("cold", writer, None), ("device", writer, "device"), ("l3", reader, "storage"))
    for case, engine, tier in cases:
        salt = f"{case}-{rep}"
        if tier is not None:
            writer.prefill(Req(rid=f"warm-{salt}", input_ids=prompt[:CACHED], cache_salt=salt,
                               max_new_tokens=1))
            writer.flush(30)
        t, cached, first = timed_prefill(engine, Req(rid=salt, input_ids=prompt,
                                                     cache_salt=salt, max_new_tokens=1))
        _expect(cached.get(tier, 0) == (CACHED if tier else 0), f"{case}: cached {cached}")
        times[case] = t
        firsts.add(first)
    _expect(len(firsts) == 1, "cached and cold runs disagree on the first token")
    return times


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark setup is wrong: {problem}")


def summarize(rounds: list[dict[str, float]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for stat, fn in (("", min), ("median_", statistics.median)):
        t = {case: fn(r[case] for r in rounds) for case in rounds[0]}
        out.update({f"{stat}cold_ttft_s": t["cold"], f"{stat}device_hit_ttft_s": t["device"],
                    f"{stat}l3_hit_ttft_s": t["l3"],
                    f"{stat}device_hit_ttft_ratio": t["device"] / t["cold"],
                    f"{stat}l3_hit_ttft_ratio": t["l3"] / t["cold"]})
    out["samples_s"] = {case: [r[case] for r in rounds] for case in rounds[0]}
    return out


def report(r: dict, stat: str) -> str:
    return (f"cold {r[f'{stat}cold_ttft_s'] * 1e3:7.1f} ms | L1 hit "
            f"{r[f'{stat}device_hit_ttft_s'] * 1e3:6.1f} ms "
            f"({r[f'{stat}device_hit_ttft_ratio']:.3f}x) | L3 hit "
            f"{r[f'{stat}l3_hit_ttft_s'] * 1e3:6.1f} ms ({r[f'{stat}l3_hit_ttft_ratio']:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as root:
        path = make_tiny_checkpoint(f"{root}/tiny-llama", seed=SEED, **SHAPE)
        model = ModelConfig.from_pretrained(path)
        cfg = PDCacheConfig(model=model, cache=CacheConfig(page_size=PAGE, device_pages=512,
                                                           host_pages=1024))
        rng = random.Random(SEED)
        prompt = [rng.randrange(model.vocab_size) for _ in range(PROMPT)]
        print(f"torch threads: {torch.get_num_threads()}  checkpoint: {model.architecture}, "
              f"{model.num_layers} layers, hidden {model.hidden_size}  prompt: {PROMPT} tokens, "
              f"{CACHED} cached  page size: {PAGE}  repeats: {args.repeats}")
        backend = make_backend(cfg.storage, cfg.layout)
        writer, reader = LocalEngine(cfg, storage=backend), LocalEngine(cfg, storage=backend)
        one_round(writer, reader, prompt, -1)             # warm-up: pools, kernels
        result = summarize([one_round(writer, reader, prompt, rep)
                            for rep in range(args.repeats)])
        for engine in (writer, reader):
            engine.close()
    for stat in ("", "median_"):
        print(f"{stat[:-1] or 'min':>6}: " + report(result, stat))
    write_result(RESULTS, {
        "benchmark": "hf_checkpoint_ttft", "seed": SEED, "checkpoint": SHAPE,
        "torch_threads": torch.get_num_threads(), "prompt_tokens": PROMPT,
        "cached_tokens": CACHED, "page_size": PAGE, "repeats": args.repeats, **result,
    }, show="name")


if __name__ == "__main__":
    main()
