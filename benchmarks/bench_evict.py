"""Radix eviction cost per insert into full pools: incremental candidates vs a tree scan.

Two caches receive the same requests, one insert each in turn: ``RadixCache`` as it is
(``pd_cache.kv.lru``: eviction costs what it evicts) and the same class whose eviction
builds its heap by walking the whole tree on every call (the design it replaced, copied
below). Pools: device 1k, 4k and 16k pages, host twice that, write-through. Requests share
one of 32 system prompts (8 pages) and add 8 pages of their own; once both pools are full,
each measured insert evicts 8 device pages and 8 host pages. Both caches must end with
the same tree (the same evictions), or the run fails. A third cache, with pools that never
fill, gives the cost of the same inserts without any eviction.

    python benchmarks/bench_evict.py [--inserts N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.core.config import KVLayout
from pd_cache.kv import CacheKey, PagePool, RadixCache
from pd_cache.kv.lru import Candidates, scan_evict
from pd_cache.kv.node import Node, iter_nodes

RESULTS = Path(__file__).parent / "results" / "evict.json"
SEED = 1234
PS = 16
LAYOUT = KVLayout(model_id="bench", kv_dtype="float32", num_layers=1, page_size=PS,
                  num_kv_heads=1, head_dim=8)
PROMPTS, PROMPT_PAGES, OWN_PAGES = 32, 8, 8


class ScanCache(RadixCache):
    """The former eviction: a heap of every evictable node, from a walk of the tree."""

    scan = True   # off while filling the pools (the two give the same evictions)

    def _evict(self, n: int, candidates: Candidates, evictable: Callable[[Node], bool],
               release: Callable[[Node], None]) -> int:
        if not self.scan:
            return super()._evict(n, candidates, evictable, release)
        return scan_evict(self.root, n, evictable, release)


def requests(rng: random.Random) -> Callable[[], CacheKey]:
    prompts = [[rng.randrange(50_000) for _ in range(PROMPT_PAGES * PS)]
               for _ in range(PROMPTS)]

    def one() -> CacheKey:
        own = [rng.randrange(50_000) for _ in range(OWN_PAGES * PS)]
        return CacheKey.build(rng.choice(prompts) + own, page_size=PS)
    return one


def serve(cache: RadixCache, key: CacheKey, pages: torch.Tensor) -> float:
    """A prefill's cache calls: match (an LRU touch), then insert; the insert is timed."""
    cache.match_prefix(key)
    start = time.perf_counter()
    cache.insert(key, pages)
    return time.perf_counter() - start


def snapshot(cache: RadixCache) -> list[tuple[bytes, int | None, int | None]]:
    return sorted((n.name, n.device_slot, n.host_slot) for n in iter_nodes(cache.root))


def bench_size(device_pages: int, inserts: int) -> dict[str, float]:
    roomy = 3 * device_pages + (inserts + PROMPTS) * (PROMPT_PAGES + OWN_PAGES)
    caches = {name: cls(PagePool("device", device, LAYOUT), PagePool("host", host, LAYOUT))
              for name, cls, device, host in (
                  ("incremental", RadixCache, device_pages, 2 * device_pages),
                  ("scan", ScanCache, device_pages, 2 * device_pages),
                  ("no_eviction", RadixCache, roomy, roomy))}
    caches["scan"].scan = False
    next_key = requests(random.Random(SEED))
    pages = torch.zeros(PROMPT_PAGES + OWN_PAGES, *LAYOUT.page_shape)
    while caches["incremental"].host.num_free or caches["scan"].host.num_free:
        key = next_key()
        for cache in caches.values():
            serve(cache, key, pages)
    caches["scan"].scan = True
    times: dict[str, list[float]] = {name: [] for name in caches}
    for i in range(inserts):
        key = next_key()
        order = list(caches)[i % 3:] + list(caches)[:i % 3]
        for name in order:
            times[name].append(serve(caches[name], key, pages))
    if snapshot(caches["incremental"]) != snapshot(caches["scan"]):
        raise SystemExit(f"device={device_pages}: the two evictions differ")
    for cache in caches.values():
        cache.check_invariants()
    assert caches["no_eviction"].device.num_free and caches["no_eviction"].host.num_free
    out = {f"{name}_median_us": statistics.median(t) * 1e6 for name, t in times.items()}
    out.update({f"{name}_mean_us": statistics.fmean(t) * 1e6 for name, t in times.items()})
    out["nodes"] = sum(1 for _ in iter_nodes(caches["scan"].root))
    out["scan_over_incremental"] = out["scan_median_us"] / out["incremental_median_us"]
    out["incremental_over_no_eviction"] = (out["incremental_median_us"]
                                           / out["no_eviction_median_us"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inserts", type=int, default=200)
    args = parser.parse_args()
    results: dict[str, object] = {"seed": SEED, "inserts": args.inserts,
                                  "pages_per_insert": OWN_PAGES, "sizes": {}}
    for device_pages in (1024, 4096, 16384):
        r = bench_size(device_pages, args.inserts)
        results["sizes"][device_pages] = r
        print(f"device {device_pages:>6} host {2 * device_pages:>6} pages, {r['nodes']} nodes: "
              f"insert median {r['incremental_median_us']:8.1f} us (incremental) vs "
              f"{r['scan_median_us']:9.1f} us (scan): {r['scan_over_incremental']:6.1f}x; "
              f"{r['incremental_over_no_eviction']:.2f}x an insert that evicts nothing "
              f"({r['no_eviction_median_us']:.1f} us)")
    write_result(RESULTS, results)


if __name__ == "__main__":
    main()
