"""Decode's per-request buffers reused vs made new, side by side in one process.

For every request a decode worker makes a KV buffer for the whole sequence and, when its
prefix cache kept the head of the prompt, a page tensor joining kept and received pages
(``pd_cache.worker.buffers``). This runs bench_pd's multi-turn workload (its stream and
seed) through one prefill and one decode worker in this process (no Ray; decode's cache
on, 8 requests batched, each decode call on a long-lived thread of a pool as in the actor;
a round's turns prefilled, then decoded together) twice per repeat: with the worker's
``Buffers`` (taken back when a request ends, lent to the next) and with
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
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_pd import SEED, workload
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.bench.workloads import Workload
from pd_cache.core.config import CacheConfig, PDCacheConfig
from pd_cache.core.model_config import ModelConfig
from pd_cache.core.request import Req
from pd_cache.worker.actors import DECODE_CONCURRENCY
from pd_cache.worker.buffers import Buffers
from pd_cache.worker.workers import DecodeWorker, PrefillWorker

RESULTS = Path(__file__).parent / "results" / "decode_buffers.json"


def one_run(cfg: PDCacheConfig, stream: Workload, reuse: bool) -> dict:
    prefill = PrefillWorker(cfg)
    decode = DecodeWorker(cfg, max_batch=8)
    if not reuse:
        decode.engine.buffers = Buffers(keep_bytes=0)
    cpu = faults = 0.0
    answers: dict[int, list[int]] = {}
    # NOTE: long-lived threads taking calls in turn, as a threaded actor's (each thread
    # allocates from its own malloc arena)
    pool = ThreadPoolExecutor(DECODE_CONCURRENCY)
    try:
        for turn in sorted({spec.turn for spec in stream.requests}):
            calls = []
            for spec in (s for s in stream.requests if s.turn == turn):
                req = Req(rid=f"bench-{spec.index}", input_ids=spec.prompt_ids(answers),
                          max_new_tokens=spec.max_tokens, cache_salt=spec.cache_salt,
                          extra_key=spec.extra_key)
                calls.append((spec.index, req, *prefill.prefill(req, decode.reserve(req))))
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            futures = [(index, pool.submit(decode.decode, req, info, pages, states=states))
                       for index, req, info, pages, states in calls]
            answers.update((index, f.result().output_ids) for index, f in futures)
            cpu += time.process_time() - start
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before.ru_minflt
        buffers = decode.engine.buffers
        taken, reused = buffers.taken, buffers.reused
    finally:
        pool.shutdown()
        prefill.close()
        decode.close()
    n = len(answers)
    return {"decode_cpu_ms_per_request": cpu / n * 1e3, "faults_per_request": faults / n,
            "buffers_taken": taken, "buffers_reused": reused,
            "outputs": [answers[i] for i in sorted(answers)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    wl = {"tenants": 4, "clients_per_tenant": 2, "system_tokens": 1024, "rounds": args.rounds,
          "user_tokens": 256, "output_tokens": 32, "preamble_tokens": 64,
          "vocab_size": 4096, "seed": SEED}
    stream = workload(wl)
    cfg = PDCacheConfig(model=ModelConfig.preset(args.model),
                        cache=CacheConfig(device_pages=512, host_pages=2048))
    import torch

    torch.set_num_threads(1)   # NOTE: as each worker actor runs
    runs: dict[str, list[dict]] = {"reused": [], "new": []}
    for i in range(args.repeats):
        for mode in (("reused", "new") if i % 2 == 0 else ("new", "reused")):
            r = one_run(cfg, stream, mode == "reused")
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
           "workload": {**wl, "stream": stream.describe()}, "repeats": args.repeats,
           "load_average": os.getloadavg(),
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
