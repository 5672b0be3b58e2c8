"""Decode's per-request buffers reused vs made new, side by side in one process.

For every request a decode worker makes a KV buffer for the whole sequence and, when its
prefix cache kept the head of the prompt, a page tensor joining kept and received pages
(``pd_cache.worker.buffers``). This runs bench_pd's multi-turn workload through one
prefill and one decode worker in this process (no Ray; decode's cache on, 8 requests
batched, each decode call on a thread of its own as in the actor) twice per repeat: with
the worker's ``Buffers`` (taken back when a request ends, lent to the next) and with
``Buffers(keep_bytes=0)`` (every buffer new, as before). Prefill is not measured; around
each round's decode calls it measures this process's CPU seconds and minor page faults.
Both modes must draw the same tokens.

Reported per mode (medians of ``--repeats``, the modes alternated): decode CPU ms and page
faults per request; ratios reused / new. Writes benchmarks/results/decode_buffers.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.core.config import CacheConfig, PDCacheConfig
from pd_cache.core.model_config import ModelConfig
from pd_cache.core.request import Req
from pd_cache.worker.actors import DECODE_CONCURRENCY
from pd_cache.worker.buffers import Buffers
from pd_cache.worker.workers import DecodeWorker, PrefillWorker

RESULTS = Path(__file__).parent / "results" / "decode_buffers.json"
SEED = 0


def conversations(wl: dict) -> list[list[int]]:
    """Each client's opening prompt: its tenant's system prompt, then a preamble."""
    rng = random.Random(wl["seed"])
    system = [[rng.randrange(wl["vocab_size"]) for _ in range(wl["system_tokens"])]
              for _ in range(wl["tenants"])]
    return [system[c % wl["tenants"]]
            + [rng.randrange(wl["vocab_size"]) for _ in range(wl["preamble_tokens"])]
            for c in range(wl["tenants"] * wl["clients_per_tenant"])]


def one_run(cfg: PDCacheConfig, wl: dict, reuse: bool) -> dict:
    prefill = PrefillWorker(cfg)
    decode = DecodeWorker(cfg, max_batch=8)
    if not reuse:
        decode.engine.buffers = Buffers(keep_bytes=0)
    rng = random.Random(wl["seed"] + 1)
    history = conversations(wl)
    cpu = faults = 0.0
    outputs: list[list[int]] = []
    # NOTE: long-lived threads taking calls in turn, as a threaded actor's (each thread
    # allocates from its own malloc arena)
    pool = ThreadPoolExecutor(DECODE_CONCURRENCY)
    try:
        for rnd in range(wl["rounds"]):
            calls = []
            for c, ids in enumerate(history):
                ids = ids + [rng.randrange(wl["vocab_size"]) for _ in range(wl["user_tokens"])]
                req = Req(rid=f"c{c}r{rnd}", input_ids=ids, tenant=f"t{c % wl['tenants']}",
                          max_new_tokens=wl["output_tokens"])
                kept = decode.reserve(req)
                calls.append((req, *prefill.prefill(req, kept)))
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            answers = [f.result().output_ids for f in
                       [pool.submit(decode.decode, req, info, pages, states=states)
                        for req, info, pages, states in calls]]
            cpu += time.process_time() - start
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before.ru_minflt
            for c, ((req, *_), answer) in enumerate(zip(calls, answers)):
                outputs.append(answer)
                history[c] = req.input_ids + answer
        buffers = decode.engine.buffers
        taken, reused = buffers.taken, buffers.reused
    finally:
        pool.shutdown()
        prefill.close()
        decode.close()
    n = len(outputs)
    return {"decode_cpu_ms_per_request": cpu / n * 1e3, "faults_per_request": faults / n,
            "buffers_taken": taken, "buffers_reused": reused, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    wl = {"tenants": 4, "clients_per_tenant": 2, "system_tokens": 1024, "rounds": args.rounds,
          "user_tokens": 256, "output_tokens": 32, "preamble_tokens": 64,
          "vocab_size": 4096, "seed": SEED}
    cfg = PDCacheConfig(model=ModelConfig.preset(args.model),
                        cache=CacheConfig(device_pages=512, host_pages=2048))
    import torch

    torch.set_num_threads(1)   # NOTE: as each worker actor runs
    runs: dict[str, list[dict]] = {"reused": [], "new": []}
    for i in range(args.repeats):
        for mode in (("reused", "new") if i % 2 == 0 else ("new", "reused")):
            r = one_run(cfg, wl, mode == "reused")
            runs[mode].append(r)
            print(f"  {mode:>6}: decode {r['decode_cpu_ms_per_request']:.1f} CPU ms and "
                  f"{r['faults_per_request']:.0f} page faults a request "
                  f"(buffers taken {r['buffers_taken']}, reused {r['buffers_reused']})",
                  flush=True)
    same = all(r["outputs"] == runs["new"][0]["outputs"] for rs in runs.values() for r in rs)
    median = {mode: {k: statistics.median(r[k] for r in rs) for k in
                     ("decode_cpu_ms_per_request", "faults_per_request")}
              for mode, rs in runs.items()}
    for rs in runs.values():
        for r in rs:
            r.pop("outputs")
    out = {"benchmark": "decode_buffers_multi_turn", "seed": SEED, "model": args.model,
           "workload": wl, "repeats": args.repeats, "load_average": os.getloadavg(),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "runs": runs, "median": median, "outputs_equal": same,
           "decode_cpu_ratio": median["reused"]["decode_cpu_ms_per_request"]
           / median["new"]["decode_cpu_ms_per_request"],
           "faults_ratio": median["reused"]["faults_per_request"]
           / max(1.0, median["new"]["faults_per_request"])}
    print(f"decode CPU a request: reused {median['reused']['decode_cpu_ms_per_request']:.1f} "
          f"vs new {median['new']['decode_cpu_ms_per_request']:.1f} ms "
          f"({out['decode_cpu_ratio']:.2f}x); page faults "
          f"{median['reused']['faults_per_request']:.0f} vs "
          f"{median['new']['faults_per_request']:.0f} ({out['faults_ratio']:.2f}x); "
          f"outputs equal: {same}")
    write_result(RESULTS, out)
    if not same:
        raise SystemExit("reused and new buffers drew different tokens")


if __name__ == "__main__":
    main()
