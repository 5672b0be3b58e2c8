"""The cluster page index at scale: one index actor filled with 1M page entries, then KV
events replayed at 10,000/s for 60 s while routings query it.

``--publishers`` (default 64) simulated workers each start with a snapshot of their share
of the 1M names (half on device, half on host: masks as wide as 64 workers make them),
then log events through the real ``EventLog`` and ``Publisher`` (half stores of new names,
half removals of held ones, so the index stays at ~1M entries); one thread adds the
events at the target rate, each publisher's own thread flushes every ``--flush-s`` (all in
this one process: they share its GIL, which real workers do not). Measured:

- lag: for each batch, from its oldest event's ``add`` to the index applying it (p50, p99);
- bytes per entry: the index actor's resident memory over its entries (and Python's own
  count of the dict, keys and masks);
- a routing's query (64 names) p50 / p99 during the replay;
- the hot path's cost: ``EventLog.add`` of one name, in ns.

Fixed seed; writes benchmarks/results/index.json and prints the extrapolation to 64 workers
x 1M pages each.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.session import ray_session
from pd_cache.cluster.index import index_actors
from pd_cache.core.events import STORED, EventBatch, EventLog, Publisher

SEED = 26
RESULTS = Path(__file__).parent / "results" / "index.json"
QUERY_NAMES = 64


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def add_ns(n: int = 200_000) -> float:
    """Cost of the hot path's ``EventLog.add`` of one name (ns per call)."""
    log, name = EventLog(), (os.urandom(16),)
    start = time.perf_counter()
    for _ in range(n):
        log.add(STORED, "device", name)
    return (time.perf_counter() - start) / n * 1e9


class Worker:
    """One simulated publisher: what it holds, its log and its ``Publisher``."""

    def __init__(self, name: str, names: list[bytes], actor: Any, flush_s: float) -> None:
        self.held = names
        self.on_host = set(names[1::2])   # the rest are on device
        self.log = EventLog()

        def send(shard: int, batch: EventBatch) -> bool:
            import ray

            return ray.get(actor.publish.remote(batch), timeout=30)

        tiers = {"device": names[::2], "host": names[1::2]}
        self.pub = Publisher(name, self.log, 1, send, lambda: tiers, flush_s)


def fill(actor: Any, workers: list[Worker]) -> float:
    import ray

    start = time.perf_counter()
    for w in workers:
        w.pub.flush()   # first contact: its snapshot
        assert w.pub.stale == [False]
    ray.get(actor.stats.remote())
    return time.perf_counter() - start


def replay(actor: Any, workers: list[Worker], rate: float, seconds: float,
           rng: random.Random) -> dict[str, Any]:
    import ray

    stop, counts = threading.Event(), {"events": 0}

    def produce() -> None:
        tick, start = 0.01, time.perf_counter()
        while not stop.is_set():
            due = int((time.perf_counter() - start) * rate) - counts["events"]
            for _ in range(max(0, due)):
                w = workers[rng.randrange(len(workers))]
                if rng.random() < 0.5 and w.held:
                    i = rng.randrange(len(w.held))
                    w.held[i], gone = w.held[-1], w.held[i]
                    w.held.pop()
                    tier = "host" if gone in w.on_host else "device"
                    w.on_host.discard(gone)
                    w.log.add(False, tier, (gone,))
                else:
                    name = rng.randbytes(16)
                    w.held.append(name)
                    w.log.add(STORED, "device", (name,))
                counts["events"] += 1
            time.sleep(tick)

    ray.get(actor.take_lags.remote())
    threads = [threading.Thread(target=produce)]
    for t in threads:
        t.start()
    for w in workers:   # each on its own thread, as in a worker process
        w.pub.start()
    queries, start = [], time.perf_counter()
    sample = [n for w in workers for n in w.held[:2]]
    while time.perf_counter() - start < seconds:
        names = rng.sample(sample, QUERY_NAMES)
        t0 = time.perf_counter()
        ray.get(actor.query.remote(names))
        queries.append(time.perf_counter() - t0)
        time.sleep(0.1)
    elapsed = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    for w in workers:
        w.pub.stop()
    time.sleep(4 * workers[0].pub.flush_s)
    lags = ray.get(actor.take_lags.remote())
    return {"events": counts["events"], "events_per_s": counts["events"] / elapsed,
            "seconds": elapsed, "batches": len(lags),
            "lag_p50_ms": pct(lags, 0.5) * 1e3, "lag_p99_ms": pct(lags, 0.99) * 1e3,
            "lag_max_ms": max(lags) * 1e3 if lags else float("nan"),
            "query_p50_ms": pct(queries, 0.5) * 1e3, "query_p99_ms": pct(queries, 0.99) * 1e3,
            "queries": len(queries)}


def extrapolate(bytes_per_entry: float, workers: int = 64, pages: int = 1_000_000,
                shard_bytes: float = 4 * 2**30) -> dict[str, float]:
    """64 workers x 1M pages each, no page shared (the worst case): one entry per page."""
    entries = workers * pages
    memory = entries * bytes_per_entry
    return {"workers": workers, "pages_per_worker": pages, "entries": entries,
            "memory_gib": memory / 2**30, "shard_budget_gib": shard_bytes / 2**30,
            "shards_by_memory": -(-memory // shard_bytes)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    rng = random.Random(SEED)
    actor = index_actors(1, 4 * args.entries, f"bench-index-{os.getpid()}", "pd-cache-bench",
                         detached=False)[0]
    base_rss = ray.get(actor.rss.remote())
    per = args.entries // args.publishers
    workers = [Worker(f"{'prefill' if i % 2 else 'decode'}-{i // 2}",
                      [rng.randbytes(16) for _ in range(per)], actor, args.flush_s)
               for i in range(args.publishers)]
    fill_s = fill(actor, workers)
    stats = ray.get(actor.stats.remote())
    rss = ray.get(actor.rss.remote())
    sizes = ray.get(actor.footprint.remote())
    entries = stats["entries"]
    out = {"seed": SEED, "python": sys.version.split()[0], "machine": platform.machine(),
           "publishers": args.publishers, "flush_s": args.flush_s, "entries": entries,
           "fill_s": fill_s, "rss_bytes_per_entry": (rss - base_rss) / entries,
           "python_bytes_per_entry": sizes / entries, "add_ns": add_ns(),
           "target_events_per_s": args.rate}
    out |= replay(actor, workers, args.rate, args.seconds, rng)
    out["entries_after"] = ray.get(actor.stats.remote())["entries"]
    out["extrapolation"] = extrapolate(out["rss_bytes_per_entry"])
    ray.kill(actor)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--publishers", type=int, default=64)
    parser.add_argument("--rate", type=float, default=10_000.0, help="events per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--flush-s", type=float, default=0.05,
                        help="each publisher's flush period (the workers' default)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with ray_session(None):   # a throwaway cluster of its own
        r = run(args)
    x = r["extrapolation"]
    print(f"{r['entries']:,} entries: {r['rss_bytes_per_entry']:.0f} B/entry resident "
          f"({r['python_bytes_per_entry']:.0f} counted by Python); fill {r['fill_s']:.1f} s")
    print(f"replay {r['events_per_s']:,.0f} events/s for {r['seconds']:.0f} s in "
          f"{r['batches']:,} batches: lag p50 {r['lag_p50_ms']:.1f} ms, p99 "
          f"{r['lag_p99_ms']:.1f} ms, max {r['lag_max_ms']:.1f} ms; query of {QUERY_NAMES} "
          f"names p50 {r['query_p50_ms']:.2f} ms, p99 {r['query_p99_ms']:.2f} ms")
    print(f"EventLog.add: {r['add_ns']:.0f} ns a call")
    print(f"64 workers x 1M pages: {x['entries']:,} entries, {x['memory_gib']:.1f} GiB, "
          f"{x['shards_by_memory']:.0f} shards of {x['shard_budget_gib']:.0f} GiB")
    write_result(args.out, r)


if __name__ == "__main__":
    main()
