"""L3 replicas: the L3 hits a memory shard killed after the first round costs, with one
copy of each page (``storage_replicas`` 1) and with two (2).

``make run``'s multi-turn chat (4 tenants x 4 users x 3 rounds, 512-token system prompts,
64-token user turns, 16-token answers, the small model, 48 device and 96 host pages a
worker) on 2 prefill, 2 decode workers and 2 memory shards, one round at a time (every
request of a round in flight at once). For each replica count one cluster runs the
workload twice per repetition, side by side: undisturbed, and with ``kill -9`` of shard 0
after the first round (it comes back empty); every cache tier is emptied before each run
(``drop_caches``), so both runs start from nothing and send the same prompts.

``l3_hit_ratio_after_kill``: L3 hit tokens (``cached_tokens['storage']``) over the rounds
after the kill / the same rounds of the undisturbed run; medians of the repetitions. Target
with 2 copies: >= 0.9. After each run with a kill (2 copies), ``rebuild_storage`` copies to
the restarted shard what it still lacks (pages, bytes, seconds at its default cap).

    python benchmarks/bench_replicas.py [--repeats 3] [--rounds 3] [--model small]

Starts its own local Ray cluster (token-authenticated, no dashboard) and shuts it down.
Writes benchmarks/results/replicas.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache import ClusterConfig, PDCluster, Req
from pd_cache.app.bench.workloads import Workload, multi_turn_workload
from pd_cache.app.session import cluster_token

SEED = 1234
RESULTS = Path(__file__).parent / "results" / "replicas.json"


def workload(args: argparse.Namespace, vocab: int) -> Workload:
    return multi_turn_workload(args.tenants, args.users, args.rounds,
                               system_tokens=args.system_len, user_tokens=args.user_tokens,
                               output_tokens=args.output_len, vocab_size=vocab, seed=SEED)


def kill_shard(cluster: PDCluster, shard: int) -> float:
    """kill -9 of a shard's process; seconds until a new one answers."""
    import ray

    pid, start = ray.get(cluster.storage[shard].ping.remote()), time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while ray.get(cluster.storage[shard].ping.remote(), timeout=60) == pid:
        time.sleep(0.05)
    return time.perf_counter() - start


def one_run(cluster: PDCluster, wl: Workload, kill: bool) -> dict[str, Any]:
    """The workload round by round from empty caches; L3 hit tokens of the rounds after
    the first (shard 0 killed between, with ``kill``)."""
    cluster.drop_caches()
    answers: dict[int, list[int]] = {}
    hits, prompt_tokens, restart_s = 0, 0, 0.0
    for turn in range(max(s.turn for s in wl.requests) + 1):
        specs = [s for s in wl.requests if s.turn == turn]
        reqs = [Req(rid=f"{s.session}/{turn}/{kill}", input_ids=s.prompt_ids(answers),
                    extra_key=s.extra_key, cache_salt=s.cache_salt,
                    max_new_tokens=s.max_tokens) for s in specs]
        outs = cluster.generate_many(reqs)
        for s, r, out in zip(specs, reqs, outs):
            answers[s.index] = out.output_ids
            if turn:
                hits += out.cached_tokens.get("storage", 0)
                prompt_tokens += len(r.input_ids)
        if turn == 0:
            cluster.flush()
            if kill:
                restart_s = kill_shard(cluster, 0)
    cluster.flush()
    out = {"l3_hit_tokens": hits, "prompt_tokens": prompt_tokens, "restart_s": restart_s}
    if kill and cluster.pd.storage.replicas > 1:   # after the rounds measured
        start = time.perf_counter()
        out["rebuild"] = {**cluster.rebuild_storage(), "seconds": time.perf_counter() - start}
    return out


def bench(args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    config = ClusterConfig(model=args.model, num_prefill=2, num_decode=2, num_storage=2,
                           storage_replicas=replicas, device_pages=args.device_pages,
                           host_pages=args.host_pages, page_size=16)
    wl = workload(args, config.pd_config.model.vocab_size)
    cluster = PDCluster.start(config)
    runs: list[dict[str, Any]] = []
    try:   # NOTE: no warm-up: what is measured is tokens, not time
        for rep in range(args.repeats):
            pair = {kill: one_run(cluster, wl, kill) for kill in ((False, True) if rep % 2
                                                                  else (True, False))}
            runs.append({"undisturbed": pair[False], "killed": pair[True],
                         "ratio": pair[True]["l3_hit_tokens"]
                         / max(1, pair[False]["l3_hit_tokens"])})
    finally:
        cluster.shutdown(check=True)
    ratio = statistics.median(r["ratio"] for r in runs)
    print(f"storage_replicas={replicas}: L3 hit tokens after the kill / undisturbed: "
          + ", ".join(f"{r['killed']['l3_hit_tokens']}/{r['undisturbed']['l3_hit_tokens']}"
                      for r in runs) + f" -> median {ratio:.3f}"
          + "".join(f" | rebuild {r['killed']['rebuild']}" for r in runs
                    if "rebuild" in r["killed"]))
    return {"l3_hit_ratio_after_kill": ratio, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=48)
    parser.add_argument("--host-pages", type=int, default=96)
    args = parser.parse_args()
    import ray

    with cluster_token():   # a throwaway cluster of its own, token-authenticated
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 logging_level="WARNING", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            by_r = {r: bench(args, r) for r in (2, 1)}
        finally:
            ray.shutdown()
    results = {"seed": SEED, "workload": vars(args),
               "l3_hit_ratio_after_kill": by_r[2]["l3_hit_ratio_after_kill"],
               "l3_hit_ratio_after_kill_r1": by_r[1]["l3_hit_ratio_after_kill"],
               "meets_target": by_r[2]["l3_hit_ratio_after_kill"] >= 0.9,
               "replicas": {str(r): v for r, v in by_r.items()}}
    write_result(RESULTS, results, show=None)
    print(f"l3_hit_ratio_after_kill {results['l3_hit_ratio_after_kill']:.3f} with 2 copies "
          f"(target >= 0.9: {'met' if results['meets_target'] else 'NOT met'}), "
          f"{results['l3_hit_ratio_after_kill_r1']:.3f} with 1; wrote {RESULTS}")


if __name__ == "__main__":
    main()
