"""What one L3 call costs in CPU, by kind, against a call that does nothing, in one run.

Where `bench_pd.py`'s cache-on run spends what its strict bound does not allow: the L3
calls each request makes (the prefill's lookup and write-through, decode's offload) and
the tier actors that answer them. One StorageTier actor (memory backend) with the small
preset's pages (what `bench_pd.py` serves, 32 KiB a page), ``--pages`` pages a call, and
for each kind of call the wall time, the tier process's CPU and this process's CPU per
call (Linux ``/proc``), medians over ``--repeats`` rounds of ``--calls`` calls:

  ping     ``StorageTier.ping``: Ray's own cost of a call (the baseline)
  exists   ``StorageClient.batch_exists`` of pages the tier holds
  get      ``StorageClient.batch_get`` of them (lent blocks, verified here)
  set      ``StorageClient.batch_set`` of fresh pages (the write-through's call)
  sealed   a worker's write-through set: fresh pages sealed into arena slots from an
           ``arena_grant`` call made for each set (``ArenaWriter(lease_ahead=0)``)
  leased   the same, its slots from a lease of 64 taken with an earlier grant call (a
           call every 64 / ``--pages`` + 1 sets: the workers' default)

Writes benchmarks/results/tier_calls.json (``*_vs_ping`` = CPU of both processes over a
ping's).

    python benchmarks/bench_tier_calls.py [--pages N] [--calls C] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_storage import chain_records  # this folder: how its records are named
from core_timeline import process_cpu  # this folder
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.session import cluster_token
from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.sealing import Keyring
from pd_cache.storage import PageRecord
from pd_cache.storage.arena_writer import ArenaWriter
from pd_cache.storage.base import ExtraInfo
from pd_cache.storage.client import StorageClient
from pd_cache.storage.seal import SealedStorage, Sealer
from pd_cache.storage.tier import storage_actors

RESULTS = Path(__file__).parent / "results" / "tier_calls.json"
KINDS = ("ping", "exists", "get", "set", "sealed", "leased")
SEED = 1234


def records(cfg: PDCacheConfig, n: int, salt: str) -> list[PageRecord]:
    """``n`` fresh pages of the small preset, named in namespace ``salt``."""
    gen = torch.Generator().manual_seed(SEED)
    return chain_records(cfg.layout, [torch.randn(cfg.layout.page_shape, generator=gen)
                                      for _ in range(n)], salt)


def per_call(call: Any, calls: int, tier_pid: int) -> dict[str, float]:
    """Wall seconds, tier CPU and caller CPU of one call (``call(i)``, i < ``calls``)."""
    tier, me, start = process_cpu(tier_pid), process_cpu(os.getpid()), time.perf_counter()
    for i in range(calls):
        call(i)
    wall = time.perf_counter() - start
    return {"wall_ms": 1e3 * wall / calls,
            "tier_cpu_ms": 1e3 * (process_cpu(tier_pid) - tier) / calls,
            "caller_cpu_ms": 1e3 * (process_cpu(os.getpid()) - me) / calls}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    cfg = PDCacheConfig(model=ModelConfig.preset("small"), cache=CacheConfig(page_size=16),
                        storage=StorageConfig(capacity_bytes=1 << 30, num_shards=1))
    handle = storage_actors(cfg)[0]
    try:
        pid = ray.get(handle.ping.remote())
        client = StorageClient([handle], timeout_s=60)
        stored = records(cfg, args.pages, "stored")
        names = [r.name for r in stored]
        assert all(client.batch_set(names, stored))
        rounds: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
        sealer, tenant = Sealer(Keyring.random()), ExtraInfo(tenant="bench")
        sealing = StorageClient([handle], timeout_s=60, layout=cfg.layout)
        writers = {kind: SealedStorage(sealing, sealer, scratch_bytes=1 << 20,
                                       arena=ArenaWriter(sealing, lease_ahead=ahead))
                   for kind, ahead in (("sealed", 0), ("leased", 64))}
        for rep in range(args.repeats + 1):   # the first round warms up and is dropped
            fresh = [records(cfg, args.pages, f"fresh-{rep}-{i}") for i in range(args.calls)]
            run_ = {
                "ping": per_call(lambda i: ray.get(handle.ping.remote()), args.calls, pid),
                "exists": per_call(lambda i: client.batch_exists(names), args.calls, pid),
                "get": per_call(lambda i: client.batch_get(names), args.calls, pid),
                "set": per_call(lambda i, batches=fresh: client.batch_set(
                    [r.name for r in batches[i]], batches[i]), args.calls, pid),
            }
            for kind, store in writers.items():
                batches = [records(cfg, args.pages, f"{kind}-{rep}-{i}")
                           for i in range(args.calls)]
                run_[kind] = per_call(lambda i, b=batches, w=store: w.batch_set(
                    [r.name for r in b[i]], b[i], tenant), args.calls, pid)
            if rep:
                for kind, figures in run_.items():
                    rounds[kind].append(figures)
    finally:
        ray.kill(handle)
    out: dict[str, Any] = {"seed": SEED, "model": "small", "page_bytes": stored[0].nbytes,
                           "pages_per_call": args.pages, "calls": args.calls,
                           "repeats": args.repeats, "machine": {"cpus": os.cpu_count()}}
    for kind, runs in rounds.items():
        out[kind] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out[kind]["cpu_ms"] = out[kind]["tier_cpu_ms"] + out[kind]["caller_cpu_ms"]
    for kind in KINDS[1:]:
        out[f"{kind}_vs_ping"] = out[kind]["cpu_ms"] / out["ping"]["cpu_ms"]
    out["leased_vs_sealed"] = out["leased"]["cpu_ms"] / out["sealed"]["cpu_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=16, help="pages a call")
    parser.add_argument("--calls", type=int, default=100, help="calls a round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians)")
    args = parser.parse_args()
    import ray

    with cluster_token():
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 logging_level="WARNING")
        try:
            out = run(args)
        finally:
            ray.shutdown()
    for kind in KINDS:
        f = out[kind]
        ratio = f" ({out[f'{kind}_vs_ping']:.1f}x a ping)" if kind != "ping" else ""
        print(f"{kind:>6}: {f['wall_ms']:.2f} ms wall, CPU {f['tier_cpu_ms']:.2f} ms in the "
              f"tier + {f['caller_cpu_ms']:.2f} ms here = {f['cpu_ms']:.2f} ms{ratio}")
    print(f"leased / sealed set CPU: {out['leased_vs_sealed']:.2f}x")
    write_result(RESULTS, out)


if __name__ == "__main__":
    main()
