"""Page-hash chain throughput: pd-cache's chain against three designs, side by side.

Names for 1M tokens at page sizes 16 and 64, every design fed the same little-endian
uint32 buffer (from a list input, the list is turned into that buffer once, the
cheapest way, and that cost is charged to every design alike):
  ours            pd_cache.core.hashing.page_hashes (xxh3_128 chain)
  sha256_per_page one hashlib.sha256 call per page over prior || page bytes
  python_per_token a Python loop feeding each token's 4 bytes to sha256 in turn
  raw_xxh3        one xxh3_128 pass over the whole buffer (no chain: the upper limit)

    python benchmarks/bench_hashing.py [--tokens N] [--repeats R]
"""

from __future__ import annotations

import argparse
import array
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.core.hashing import namespace_seed, page_hashes

RESULTS = Path(__file__).parent / "results" / "hashing.json"
SEED = 1234


def sha256_per_page(buf: bytes, page_size: int) -> list[bytes]:
    prior, step, names = namespace_seed(None, None, "sha256"), page_size * 4, []
    for start in range(0, len(buf) - step + 1, step):
        prior = hashlib.sha256(prior + buf[start:start + step]).digest()
        names.append(prior)
    return names


def python_per_token(buf: bytes, page_size: int) -> list[bytes]:
    prior, step, names = namespace_seed(None, None, "sha256"), page_size * 4, []
    for start in range(0, len(buf) - step + 1, step):
        h = hashlib.sha256(prior)
        for pos in range(start, start + step, 4):
            h.update(buf[pos:pos + 4])
        prior = h.digest()
        names.append(prior)
    return names


def list_to_buffer(tokens: list[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def timed(fn: Callable[[], object], repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def bench_page_size(tokens: np.ndarray, as_list: list[int], page_size: int,
                    repeats: int) -> dict[str, float]:
    buf = tokens.tobytes()
    slow_repeats = max(1, repeats // 3)
    t = {
        "ours": timed(lambda: page_hashes(tokens, page_size), repeats),
        "sha256_per_page": timed(lambda: sha256_per_page(buf, page_size), repeats),
        "python_per_token": timed(lambda: python_per_token(buf, page_size), slow_repeats),
        "raw_xxh3": timed(lambda: xxhash.xxh3_128_digest(buf), repeats),
        "ours_list": timed(lambda: page_hashes(as_list, page_size), repeats),
        "python_per_token_list": timed(
            lambda: python_per_token(list_to_buffer(as_list), page_size), slow_repeats),
    }
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, 2**17, size=args.tokens).astype("<u4")
    as_list = tokens.tolist()
    assert page_hashes(tokens, 64) == page_hashes(as_list, 64)

    results: dict[str, object] = {"tokens": args.tokens, "seed": SEED, "page_sizes": {}}
    for page_size in (16, 64):
        t = bench_page_size(tokens, as_list, page_size, args.repeats)
        ratios = {
            "vs_sha256_per_page": t["sha256_per_page"] / t["ours"],
            "vs_python_per_token": t["python_per_token"] / t["ours"],
            "fraction_of_raw_xxh3": t["raw_xxh3"] / t["ours"],
            "vs_python_per_token_list": t["python_per_token_list"] / t["ours_list"],
        }
        results["page_sizes"][page_size] = {"seconds": t, **ratios}
        print(f"page_size={page_size}")
        for name, seconds in t.items():
            print(f"  {name:<22} {args.tokens / seconds / 1e6:10.2f} M tokens/s")
        for name, ratio in ratios.items():
            print(f"  {name:<26} {ratio:8.3f}")
    headline = results["page_sizes"][64]
    for key in ("vs_sha256_per_page", "vs_python_per_token", "fraction_of_raw_xxh3",
                "vs_python_per_token_list"):
        results[key] = headline[key]
    write_result(RESULTS, results)


if __name__ == "__main__":
    main()
