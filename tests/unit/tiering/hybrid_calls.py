"""A hybrid model's prompt and the v2 calls its write-through and prefetch must make: which
pages each operation names, which carry the trailing ``state`` sidecar, and the prefix
context and namespace seed in ``extra_info``.
"""

from __future__ import annotations

import random

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.hashing import namespace_seed, page_hashes

PS = 4
HYBRID = ModelConfig.preset("tiny-hybrid")
P = [random.Random(12).randrange(HYBRID.vocab_size) for _ in range(42)]   # 10 full pages
NAMES = page_hashes(P, PS, cache_salt="t")
SEED = namespace_seed(None, "t")
# Checkpoints of a write of pages 0..9 (every 4th page, and the last); with batches of 3
# pages, each batch ends at a checkpoint or after 3 pages.
WRITE_RUNS = [(0, 3), (3, 4), (4, 7), (7, 8), (8, 10)]
# The pages whose state a write stores (its checkpoints) and a full read asks for.
STATES = {3, 7, 9}


def config(prefix_keys: bool) -> PDCacheConfig:
    return PDCacheConfig(model=HYBRID, cache=CacheConfig(page_size=PS, device_pages=64,
                                                         host_pages=64),
                         storage=StorageConfig(batch_pages=3, prefix_keys=prefix_keys,
                                               prefetch_policy="wait_complete"))


def check_calls(calls: list, op: str, runs: list[tuple[int, int]], rid: str,
                prefix_keys: bool) -> None:
    mine = [c for c in calls if c[0] == op]
    assert [(NAMES.index(pools[0][1][0]), NAMES.index(pools[0][1][-1]) + 1)
            for _, pools, _, _ in mine] == runs
    for (_, pools, info, copy), (lo, hi) in zip(mine, runs):
        assert pools[0] == ("kv", NAMES[lo:hi])
        want_state = [("state", NAMES[hi - 1:hi])] if hi - 1 in STATES else []
        assert pools[1:] == want_state, (op, lo, hi)
        assert info.namespace_seed == SEED and info.request_id == rid
        if not prefix_keys:
            assert info.prefix_keys is None and copy is None
            continue
        # the operation's context: the names before its first key, never changed since
        assert list(info.prefix_keys) == copy == NAMES[:lo], (op, lo)
