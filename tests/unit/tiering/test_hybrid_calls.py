"""What a v2 backend receives from a hybrid model's write-through and prefetch.

Every write and read of KV and state is a v2 call whose ``state`` transfer is a trailing
sidecar (the last page of the operation, a checkpoint); ``extra_info`` carries the
operation's prefix context in its three states and the request's namespace seed.
"""

from __future__ import annotations

import random

import pytest

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.core.request import Req
from pd_cache.storage import make_backend
from pd_cache.worker.engine import LocalEngine
from tests.unit.storage.test_storage_v2 import Recorder

PS = 4
HYBRID = ModelConfig.preset("tiny-hybrid")
P = [random.Random(12).randrange(HYBRID.vocab_size) for _ in range(42)]   # 10 full pages
NAMES = page_hashes(P, PS, cache_salt="t")
SEED = namespace_seed(None, "t")
# Checkpoints of a write of pages 0..9 (every 4th page, and the last); with batches of 3
# pages, each batch ends at a checkpoint or after 3 pages.
WRITE_RUNS = [(0, 3), (3, 4), (4, 7), (7, 8), (8, 10)]
# A read after a local hit of 2 pages: it asks for states at pages 3, 7 and 9.
READ_RUNS_AFTER_TWO = [(2, 4), (4, 7), (7, 8), (8, 10)]
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


@pytest.mark.parametrize("prefix_keys", [True, False])
@pytest.mark.parametrize("local_hit", [0, 2])
def test_v2_calls_carry_kv_the_trailing_state_and_the_operations_prefix(
        prefix_keys: bool, local_hit: int) -> None:
    cfg = config(prefix_keys)
    store = Recorder(make_backend(cfg.storage, cfg.layout))
    writer = LocalEngine(cfg, storage=store)
    writer.prefill(Req(rid="w", input_ids=P, cache_salt="t", max_new_tokens=1))
    assert writer.flush(10)
    check_calls(store.calls, "set", WRITE_RUNS, "w", prefix_keys)
    if prefix_keys:
        first_set = next(c for c in store.calls if c[0] == "set")
        assert first_set[3] == []            # on, the chain starts at the namespace seed
    writer.close()

    reader = LocalEngine(cfg, storage=store)
    if local_hit:    # a 9-token prompt keeps pages 0, 1 and the state after page 1
        reader.prefill(Req(rid="warm", input_ids=P[:9], cache_salt="t", max_new_tokens=1))
        assert reader.flush(10)
    store.calls.clear()
    out = reader.prefill(Req(rid="r", input_ids=P, cache_salt="t", max_new_tokens=1))
    assert out.cached_tokens["storage"] == (10 - local_hit) * PS
    runs = READ_RUNS_AFTER_TWO if local_hit else WRITE_RUNS
    check_calls(store.calls, "get", runs, "r", prefix_keys)
    exists = [c for c in store.calls if c[0] == "exists"]
    assert exists and all(pools == [("kv", pools[0][1])] for _, pools, _, _ in exists)
    assert exists[0][1][0][1][0] == NAMES[local_hit]
    assert exists[0][3] == (NAMES[:local_hit] if prefix_keys else None)
    assert reader.flush(10)
    reader.close()
