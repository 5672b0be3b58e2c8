"""Storage faults on the tiering paths: a write never stores what the caller changed
afterwards, and a malformed storage answer ends as a counted miss, never a failed request
or a leaked slot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pd_cache.core.request import Req
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage import make_backend
from pd_cache.storage.base import ExtraInfo, Pending, PoolTransfer, Ready
from pd_cache.worker.engine import LocalEngine
from tests.unit.tiering.fakes import (
    PS,
    SetGate,
    Wrapper,
    assert_clean,
    config,
    filled_store,
    prompt,
    reference,
)


def test_backup_snapshots_pages_so_a_caller_change_afterwards_is_not_stored() -> None:
    cfg = config(batch=2)
    store = SetGate(make_backend(cfg.storage, cfg.layout))   # the writer waits on the gate
    engine = LocalEngine(cfg, storage=store)
    p = prompt(11, 26)
    out = engine.prefill(Req(rid="w", input_ids=p, max_new_tokens=1))
    want = out.kv_pages.clone()
    out.kv_pages.fill_(7.0)              # the caller reuses its buffer before the write ran
    store.gate.set()
    assert engine.flush(10)
    names = list(out.page_names)
    records = store.inner.batch_get_v2([PoolTransfer("kv", names)])[0].pages
    assert len(names) == len(p) // PS and all(r is not None for r in records)
    for i, record in enumerate(records):
        assert torch.equal(record.payload("kv"), want[i]), i
    # and another engine served from L3 computes what the reference computes
    fresh = LocalEngine(cfg, storage=store.inner)
    r = Req(rid="r", input_ids=p, max_new_tokens=4)
    result = fresh.generate(r)
    assert result.cached_tokens["storage"] == (len(p) - 1) // PS * PS
    assert result.output_ids == reference(fresh, r)
    for e in (engine, fresh):
        assert_clean(e)
        e.close()


class Malformed(Wrapper):
    """Answers that are not of the storage API's shape."""

    def __init__(self, inner: Any, mode: str) -> None:
        super().__init__(inner)
        self.mode = mode

    def submit_exists(self, keys: Sequence[bytes],
                      extra_info: ExtraInfo | None = None) -> Pending[Any]:
        if self.mode == "exists_text":
            return Ready("abc")
        if self.mode == "exists_negative":
            return Ready(-3)
        return super().submit_exists(keys, extra_info)

    def submit_get(self, keys: Sequence[bytes],
                   extra_info: ExtraInfo | None = None) -> Pending[Any]:
        if self.mode == "get_not_a_list":
            return Ready(42)
        if self.mode == "get_not_records":
            return Ready(["not a record"] * len(keys))
        if self.mode == "get_raises_late":
            return super().submit_get(keys, extra_info).then(_explode)
        return super().submit_get(keys, extra_info)


def _explode(_: Any) -> Any:
    raise RuntimeError("the answer could not be decoded")


@pytest.mark.parametrize("mode", ["exists_text", "exists_negative", "get_not_a_list",
                                  "get_not_records", "get_raises_late"])
def test_a_malformed_storage_answer_is_a_miss_and_frees_its_slots(mode: str) -> None:
    cfg = config(batch=3, policy="wait_complete")
    p = prompt(12, 30)
    store = Malformed(filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)]), mode)
    engine = LocalEngine(cfg, storage=store)
    r = Req(rid="r", input_ids=p, max_new_tokens=4)
    result = engine.generate(r)
    assert result.output_ids == reference(engine, r)
    if mode.startswith("exists"):   # a read asks no exists: L3 serves every page it holds
        assert result.cached_tokens["storage"] == (len(p) - 1) // PS * PS
    else:
        assert result.cached_tokens["storage"] == 0
        misses = {k: v for k, v in engine.stats.snapshot().items() if k.startswith("miss/")}
        assert engine.stats.get(Event.MISS, MissReason.STORAGE_ERROR) > 0, misses
    assert not any(o.startswith("prefetch:") for o in engine.pool_usage()["host"])
    assert_clean(engine)
    engine.close()   # raises SlotError if a prefetch slot leaked
