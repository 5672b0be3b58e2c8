"""The PD cluster with the cache on vs off, one multi-turn workload, side by side in one run.

Shape after SGLang's multi-turn benchmark, scaled to a 2-core machine: 4 tenants x 2
clients, a 1,024-token system prompt shared within each tenant, 4 rounds of 256 new user
tokens, 32 output tokens, small model; ``--scale`` multiplies tenants. Each mode gets its
own cluster (2 prefill + 2 decode, and 2 storage actors with the cache on) on one local Ray
instance, warmed up by one short request per worker before the clock starts. Both modes
must produce the same tokens, request by request.

Writes benchmarks/results/pd.json (``throughput_ratio`` and ``ttft_p50_ratio`` are on/off).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from pd_cache import ClusterConfig, PDCluster, Req
from pd_cache.app.run import percentile, run_workload
from pd_cache.app.session import ray_session
from pd_cache.app.workload import WorkloadConfig
from pd_cache.cluster.pd_cluster import totals

SEED = 1234
RESULTS = Path(__file__).parent / "results" / "pd.json"


def warm_up(cluster: PDCluster) -> None:
    """One short request through every worker (its own namespace): first-call costs out."""
    for i in range(max(len(cluster.prefill), len(cluster.decode))):
        req = Req(rid=f"warm-{i}", input_ids=list(range(100 + i, 164 + i)),
                  cache_salt="bench-warm-up", max_new_tokens=4)
        cluster.generate(req, prefill_worker=i % len(cluster.prefill),
                         decode_worker=i % len(cluster.decode))
    cluster.flush()


def measure(cfg: ClusterConfig, wl: WorkloadConfig) -> dict:
    cluster = PDCluster.start(cfg)
    try:
        warm_up(cluster)
        start = time.perf_counter()
        done = run_workload(cluster, wl)
        seconds = time.perf_counter() - start
        cluster.flush()
        writes = cluster.l3_writes()
    finally:
        cluster.shutdown()
    t = totals(done)
    ttft = [c.ttft_s for c in done]
    generated = sum(len(c.output_ids) for c in done)
    cached = sum(t["cached_tokens"].values())
    return {
        "seconds": seconds, "requests": len(done),
        "requests_per_s": len(done) / seconds, "generated_tokens_per_s": generated / seconds,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "cached_tokens": t["cached_tokens"], "cached_tokens_total": cached,
        "prompt_tokens": t["prompt_tokens"], "cached_fraction": cached / t["prompt_tokens"],
        "pages_handed_off": t["pages_handed_off"], "l3_writes": writes,
        "cross_namespace_tokens": t["cross_namespace_tokens"],
        "phases_p50_s": phases(done),
        "outputs": {c.rid: c.output_ids for c in done},
    }


def phases(done: list) -> dict[str, float]:
    """Median seconds per phase: the prefill worker's own time, the wait for a prefill
    worker (TTFT minus it, the router and Ray included), KV handoff, batched decode."""
    return {"prefill": percentile([c.prefill_s for c in done], 50),
            "prefill_queue": percentile([c.ttft_s - c.prefill_s for c in done], 50),
            "handoff": percentile([c.handoff_s for c in done], 50),
            "decode": percentile([c.decode_s for c in done], 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=1, help="multiply the tenants")
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode-batch", type=int, default=ClusterConfig.decode_batch,
                        help="requests a decode worker steps together (1: one at a time); "
                             "the same in both modes")
    parser.add_argument("--decode-pack", action=argparse.BooleanOptionalAction, default=True,
                        help="route decode to the busiest worker with batch room (fuller "
                             "batches) instead of the least loaded; the same in both modes")
    args = parser.parse_args()
    wl = WorkloadConfig(tenants=4 * args.scale, clients_per_tenant=2, system_tokens=1024,
                        rounds=args.rounds, user_tokens=256, output_tokens=32, seed=SEED)
    base = ClusterConfig(model=args.model, device_pages=512, host_pages=2048,
                         decode_batch=args.decode_batch, decode_pack=args.decode_pack)
    results = {}
    with ray_session(None):
        for mode, cache in (("on", True), ("off", False)):
            cfg = ClusterConfig(**{**base.__dict__, "cache": cache})
            results[mode] = measure(cfg, wl)
            r = results[mode]
            print(f"cache {mode:>3}: {r['seconds']:.2f} s, {r['requests_per_s']:.2f} req/s, "
                  f"{r['generated_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{r['ttft_p50_s'] * 1e3:.1f} ms p90 {r['ttft_p90_s'] * 1e3:.1f} ms, "
                  f"cached {r['cached_tokens']}", flush=True)
            print("          phase p50 (ms): " + ", ".join(
                f"{k} {v * 1e3:.0f}" for k, v in r["phases_p50_s"].items()), flush=True)
    on, off = results["on"], results["off"]
    same = on.pop("outputs") == off.pop("outputs")
    out = {
        "benchmark": "pd_cluster_multi_turn", "seed": SEED, "model": args.model,
        "workload": wl.__dict__, "decode_batch": args.decode_batch,
        "decode_pack": args.decode_pack, "machine": {"cpus": os.cpu_count(),
                                             "python": platform.python_version()},
        "on": on, "off": off, "outputs_equal": same,
        "throughput_ratio": on["requests_per_s"] / off["requests_per_s"],
        "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"],
        "ttft_p90_ratio": on["ttft_p90_s"] / off["ttft_p90_s"],
        "target": {"throughput_ratio": ">= 2", "ttft_p50_ratio": "<= 0.4"},
    }
    out["target_met"] = out["throughput_ratio"] >= 2 and out["ttft_p50_ratio"] <= 0.4
    print(f"throughput on/off {out['throughput_ratio']:.2f}x, TTFT p50 on/off "
          f"{out['ttft_p50_ratio']:.2f}x, outputs equal: {same}, target met: "
          f"{out['target_met']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    if not same:
        raise SystemExit("cache on and off produced different tokens")


if __name__ == "__main__":
    main()
