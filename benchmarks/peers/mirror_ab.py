"""The page index's round trip in one process: two fronts over the same actors, one asking
the index per request (``index_mirror_s`` 0), one routing from its mirror, alternating.

    python benchmarks/peers/mirror_ab.py [--requests 100] [--tokens 256] [--seed 0]

``PDCluster.stream`` on 1 prefill + 1 decode + 1 L3 shard + 1 index shard, the ``tiny``
preset, one request at a time, no Serve: each request a fresh prompt (the same work on
either side), the two fronts taking turns request by request, so a drift in a shared
machine's load falls on both alike. Per side: the TTFT median and p90, and the index
queries per request (the shard's own count, read between requests). The result goes
under ``mirror_in_process`` in ``benchmarks/results/overhead.json`` (the other entries are
kept; an entry it replaces moves to ``earlier``). Run it under the shared Ray lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pd_cache import ClusterConfig, PDCluster, Req  # noqa: E402
from pd_cache.app.session import ray_session  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "overhead.json"
KEY = "mirror_in_process"
CONFIG = ClusterConfig(num_prefill=1, num_decode=1, num_storage=1, model="tiny", page_size=16,
                       device_pages=256, host_pages=256, index_shards=1, index_mirror_s=0)
SIDES = ("asked", "mirror")


async def ttft_ms(front: PDCluster, req: Req) -> float:
    """One streamed request's time to its first token (ms); the rest drained."""
    start, first = time.perf_counter(), None
    async for _item in front.stream(req):
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return (first - start) * 1e3


def queries(shard: Any) -> int:
    import ray

    return int(ray.get(shard.stats.remote()).get("query", 0))


async def measure(fronts: dict[str, PDCluster], requests: int, tokens: int,
                  seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = CONFIG.pd_config.model.vocab_size
    shard = fronts["asked"].index_actors[0]
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    asked: dict[str, int] = dict.fromkeys(SIDES, 0)
    for i in range(requests * 2 + 4):   # two warm-ups a side first
        side = SIDES[i % 2]
        req = Req(rid=f"ab-{i}", input_ids=[rng.randrange(3, vocab) for _ in range(tokens)],
                  max_new_tokens=2)
        before = queries(shard)
        ms = await ttft_ms(fronts[side], req)
        if i >= 4:
            times[side].append(ms)
            asked[side] += queries(shard) - before
    out: dict[str, Any] = {}
    for side in SIDES:
        ts = sorted(times[side])
        out[side] = {"ttft_p50_ms": round(statistics.median(ts), 2),
                     "ttft_p90_ms": round(ts[int(0.9 * (len(ts) - 1))], 2),
                     "index_queries_per_request": round(asked[side] / len(ts), 3),
                     "requests": len(ts)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="requests a side")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    load = [os.getloadavg()[0]]
    with ray_session():
        cluster = PDCluster.start(CONFIG)
        mirrored = PDCluster(replace(CONFIG, index_mirror_s=2.0), cluster.prefill,
                             cluster.decode, cluster.storage, cluster.index_actors)
        assert mirrored.mirror is not None
        end = time.monotonic() + 30
        while mirrored.mirror.answer([b"\0" * 16]) is None and time.monotonic() < end:
            time.sleep(0.05)
        try:
            result = asyncio.run(measure({"asked": cluster, "mirror": mirrored},
                                         args.requests, args.tokens, args.seed))
            result["mirror_stats"] = mirrored.mirror.stats()
        finally:
            mirrored.mirror.stop()
            cluster.shutdown(check=True)
    load.append(os.getloadavg()[0])
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result |= {"commit": commit, "load_avg_1m": [round(x, 2) for x in load],
               "prompt_tokens": args.tokens, "seed": args.seed,
               "layout": "1+1+1, index_shards 1, tiny, one process, no Serve",
               "ttft_p50_ratio_mirror_over_asked": round(
                   result["mirror"]["ttft_p50_ms"] / result["asked"]["ttft_p50_ms"], 3)}
    saved = json.loads(args.output.read_text()) if args.output.exists() else {}
    if KEY in saved:
        saved.setdefault("earlier", []).append({"layout": KEY, **saved[KEY]})
    saved[KEY] = result
    args.output.write_text(json.dumps(saved, indent=2) + "\n")
    for side in SIDES:
        print(f"{side}: {result[side]}")
    print(f"mirror / asked TTFT p50: {result['ttft_p50_ratio_mirror_over_asked']}; "
          f"load {result['load_avg_1m']}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
