"""What a v2 backend receives from a hybrid model's write-through and prefetch.

Every write and read of KV and state is a v2 call whose ``state`` transfer is a trailing
sidecar (the last page of the operation, a checkpoint); ``extra_info`` carries the
operation's prefix context in its three states and the request's namespace seed.
"""

from __future__ import annotations

import pytest

from pd_cache.core.request import Req
from pd_cache.storage import make_backend
from pd_cache.worker.engine import LocalEngine
from tests.unit.tiering.fakes import Recorder
from tests.unit.tiering.hybrid_calls import NAMES, PS, WRITE_RUNS, P, check_calls, config

# A read after a local hit of 2 pages: it asks for states at pages 3, 7 and 9.
READ_RUNS_AFTER_TWO = [(2, 4), (4, 7), (7, 8), (8, 10)]


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
