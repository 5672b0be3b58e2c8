"""Memory of the router process (what a Serve ingress holds) over many requests.

Sends ``--requests`` (default 10,000) distinct multi-tenant requests through one
``PDCluster`` (tiny model, 1 prefill + 1 decode + 1 storage actor) from this process, in
waves of ``--wave`` at once, and samples this process's resident memory after every wave
(after a GC pass). Per-request state must not outlive the request: the series should be
flat within a few MiB once warm. Fixed seed; writes benchmarks/results/router_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import time
from pathlib import Path

from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache import ClusterConfig, PDCluster, Req
from pd_cache.app.session import ray_session

SEED = 2024
RESULTS = Path(__file__).parent / "results" / "router_memory.json"


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--wave", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(SEED)
    cfg = ClusterConfig(num_prefill=1, num_decode=1, num_storage=1, model="tiny",
                        page_size=4, device_pages=256, host_pages=512)
    vocab = cfg.pd_config.model.vocab_size
    samples: list[tuple[int, float]] = []
    with ray_session(None):
        cluster = PDCluster.start(cfg)
        try:
            start, sent = time.perf_counter(), 0
            while sent < args.requests:
                n = min(args.wave, args.requests - sent)
                reqs = [Req(rid=f"m{sent + i}", cache_salt=f"tenant-{rng.randrange(64)}",
                            input_ids=[rng.randrange(vocab) for _ in range(12)],
                            max_new_tokens=1) for i in range(n)]
                cluster.generate_many(reqs)
                sent += n
                samples.append((sent, rss_mib()))
                if len(samples) % 10 == 0:
                    print(f"{sent} requests, router RSS {samples[-1][1]:.1f} MiB", flush=True)
            seconds = time.perf_counter() - start
        finally:
            cluster.shutdown()
    warm = [m for n, m in samples if n >= args.requests // 10]
    result = {
        "benchmark": "router_memory", "seed": SEED, "requests": args.requests,
        "wave": args.wave, "seconds": round(seconds, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rss_mib": [[n, round(m, 2)] for n, m in samples],
        "warm_min_mib": round(min(warm), 2), "warm_max_mib": round(max(warm), 2),
        "warm_growth_mib": round(warm[-1] - warm[0], 2),
        "bytes_per_request_after_warmup": round((warm[-1] - warm[0]) * 2**20
                                                / max(1, args.requests * 9 // 10), 1),
    }
    write_result(RESULTS, result, show=None)
    print(f"router RSS after warm-up: {result['warm_min_mib']}-{result['warm_max_mib']} MiB, "
          f"growth {result['warm_growth_mib']} MiB over {args.requests * 9 // 10} requests "
          f"({result['bytes_per_request_after_warmup']} B/request); wrote {RESULTS.name}")


if __name__ == "__main__":
    main()
