"""A hybrid model (attention + recurrent layers) through every path of the cache.

Central check, as for the plain presets: the output through the cache equals
``reference_generate``; a prefix is used only up to its last page with a recurrent state
(radix node or L3 record), never with a missing or wrong state; afterwards every page slot,
state slot and lock is back.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.core.request import Req
from pd_cache.core.vocab import STATE, MissReason
from pd_cache.model.model import Model, reference_generate
from pd_cache.storage import STATE_POOL, PoolTransfer, StorageBackend, make_backend
from pd_cache.storage.disk import DiskBackend
from pd_cache.storage.record import PageRecord, make_record
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.workers import DecodeWorker, PrefillWorker
from tests.unit.tiering.fakes import Wrapper

PS = 4
HYBRID = ModelConfig.preset("tiny-hybrid")


def config(device: int = 64, host: int = 64, **storage: Any) -> PDCacheConfig:
    return PDCacheConfig(model=HYBRID, cache=CacheConfig(page_size=PS, device_pages=device,
                                                         host_pages=host),
                         storage=StorageConfig(batch_pages=3, prefetch_policy="wait_complete",
                                               **storage))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(HYBRID.vocab_size) for _ in range(n)]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(HYBRID)


def reference(model: Model, r: Req) -> list[int]:
    return reference_generate(model, Req(rid="ref", input_ids=r.input_ids,
                                         max_new_tokens=r.max_new_tokens)).output_ids


def assert_clean(engine: LocalEngine) -> None:
    """No lock, only the tree holds slots (state slots included); then nothing at all."""
    assert engine.flush(10)
    assert engine.locks_held() == 0
    engine.cache.check_invariants()
    usage = engine.pool_usage()
    assert set(usage) == {"device", "host", "state"}
    assert all(set(owners) <= {"radix"} for owners in usage.values()), usage
    engine.cache.clear()
    assert engine.pool_usage() == {"device": {}, "host": {}, "state": {}}


def test_radix_hits_resume_from_the_last_page_with_a_state(model: Model) -> None:
    engine = LocalEngine(config())
    p = prompt(1, 42)                    # 10 full pages: checkpoints 3, 7 and 9 (the last)
    first = Req(rid="a", input_ids=p, max_new_tokens=6)
    assert engine.generate(first).output_ids == reference(model, first)
    assert engine.cache.num_states == 3
    again = Req(rid="b", input_ids=p, max_new_tokens=6)
    out = engine.generate(again)
    assert out.output_ids == reference(model, again)
    assert out.cached_tokens["device"] == 10 * PS
    # a prompt sharing 5 pages (22 tokens) resumes from page 3, the last with a state
    shared = Req(rid="c", input_ids=p[:22] + prompt(2, 13), max_new_tokens=6)
    out = engine.generate(shared)
    assert out.output_ids == reference(model, shared)
    assert out.cached_tokens["device"] == 4 * PS
    assert_clean(engine)
    engine.close()


def test_host_pages_are_loaded_back_with_their_states(model: Model) -> None:
    engine = LocalEngine(config(device=12, host=40))
    a, b = prompt(3, 42), prompt(4, 42)
    for rid, p in (("a", a), ("b", b)):    # b's pages push a's off the device, to host
        engine.generate(Req(rid=rid, input_ids=p, max_new_tokens=2))
    again = Req(rid="a2", input_ids=a, max_new_tokens=6)
    out = engine.generate(again)
    assert out.output_ids == reference(model, again)
    assert out.cached_tokens["host"] > 0
    assert out.cached_tokens["device"] + out.cached_tokens["host"] == 10 * PS
    assert_clean(engine)
    engine.close()


def test_l3_prefetch_on_a_fresh_engine_then_the_second_turn(model: Model) -> None:
    cfg = config()
    store = make_backend(cfg.storage, cfg.layout)
    first = LocalEngine(cfg, storage=store)
    turn1 = Req(rid="t1", input_ids=prompt(5, 26), cache_salt="t", max_new_tokens=12)
    assert first.generate(turn1).output_ids == reference(model, turn1)
    assert first.stats.get("offload", STATE) >= 1         # decode wrote generated states
    assert_clean(first)
    first.close()
    fresh = LocalEngine(cfg, storage=store)
    same = Req(rid="p", input_ids=turn1.input_ids, cache_salt="t", max_new_tokens=5)
    out = fresh.generate(same)
    assert out.output_ids == reference(model, same)
    assert out.cached_tokens["storage"] == 6 * PS           # every full page: 5 is a state
    assert_clean(fresh)
    fresh.close()
    second = LocalEngine(cfg, storage=store)
    turn2 = Req(rid="t2", input_ids=turn1.input_ids + turn1.output_ids + prompt(6, 7),
                cache_salt="t", max_new_tokens=5)
    out = second.generate(turn2)
    assert out.output_ids == reference(model, turn2)
    # 26 + 12 - 1 tokens had KV after turn 1: 9 pages, the last one a decode write's end
    assert out.cached_tokens["storage"] == 9 * PS
    assert second.stats.get(STATE, "hit") >= 1
    assert_clean(second)
    second.close()


def test_the_pd_handoff_carries_the_state(model: Model) -> None:
    cfg = config()
    store = make_backend(cfg.storage, cfg.layout)
    prefill, decode = PrefillWorker(cfg, storage=store), DecodeWorker(cfg, storage=store)
    r = Req(rid="r", input_ids=prompt(7, 30), max_new_tokens=9)
    info, pages, states = prefill.prefill(r)
    assert info.state_pages == (3, 6)                # checkpoints: page 3 and the last full
    assert states.shape == (3, *cfg.layout.state_shape)
    assert decode.decode(r, info, pages, states=states).output_ids == reference(model, r)
    with pytest.raises(ValueError, match="handoff carries no state"):
        decode.decode(r, info, pages)
    with pytest.raises(ValueError, match=r"handoff states: expected 3 states, got 2"):
        decode.decode(r, info, pages, states=states[:2])
    with pytest.raises(ValueError, match="handoff states: expected dtype torch.float32"):
        decode.decode(r, info, pages, states=states.half())
    for worker in (prefill, decode):
        assert_clean(worker.engine)
        worker.close()


def _stored(cfg: PDCacheConfig, store: StorageBackend, p: list[int]) -> None:
    donor = LocalEngine(cfg, storage=store)
    donor.prefill(Req(rid="d", input_ids=p, max_new_tokens=1))
    assert donor.flush(10)
    donor.close()


def test_a_missing_last_state_falls_back_to_the_last_page_with_one(model: Model,
                                                                   tmp_path: Path) -> None:
    cfg = config(backend="disk", disk_path=str(tmp_path))
    p = prompt(8, 42)                    # states at pages 3, 7 and 9
    _stored(cfg, make_backend(cfg.storage, cfg.layout), p)
    names = page_hashes(p, PS)
    files = list(tmp_path.rglob(f"{names[9].hex()}.{STATE_POOL}.rec"))
    assert len(files) == 1
    files[0].unlink()                    # the last state page is gone (a shard restarts)
    store = make_backend(cfg.storage, cfg.layout)
    assert isinstance(store, DiskBackend)
    engine = LocalEngine(cfg, storage=store)
    r = Req(rid="r", input_ids=p, max_new_tokens=6)
    out = engine.generate(r)
    assert out.output_ids == reference(model, r)
    assert out.cached_tokens["storage"] == 8 * PS            # up to page 7's state
    assert engine.stats.get(STATE, MissReason.NOT_STORED) == 1
    assert_clean(engine)
    engine.close()


class BadState(Wrapper):
    """Hands out a state record of ``victim`` whose payload was changed after it was stored."""

    def __init__(self, inner: StorageBackend, victim: bytes) -> None:
        super().__init__(inner)
        self.victim = victim

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> list[PoolTransfer]:
        out = super().batch_get_v2(transfers, extra_info)
        return [PoolTransfer(t.pool, t.keys, [self._spoil(t.pool, k, rec) for k, rec in
                                              zip(t.keys, t.pages)]) for t in out]

    def _spoil(self, pool: str, key: bytes, rec: PageRecord | None) -> PageRecord | None:
        if pool != STATE_POOL or key != self.victim or rec is None:
            return rec
        bad = rec.payloads[0].clone()
        bad.view(-1)[0] += 1.0
        return PageRecord(rec.header, (bad,))


def test_a_state_that_does_not_verify_is_never_served(model: Model) -> None:
    cfg = config()
    p = prompt(9, 42)
    names = page_hashes(p, PS)
    store = make_backend(cfg.storage, cfg.layout)
    _stored(cfg, store, p)
    engine = LocalEngine(cfg, storage=BadState(store, names[9]))
    r = Req(rid="r", input_ids=p, max_new_tokens=6)
    out = engine.generate(r)
    assert out.output_ids == reference(model, r)
    assert out.cached_tokens["storage"] == 8 * PS
    assert engine.stats.get(STATE, MissReason.VERIFICATION_FAILED) == 1
    assert_clean(engine)
    engine.close()


def test_a_state_record_of_the_wrong_shape_or_dtype_is_refused(model: Model) -> None:
    cfg = config()
    p = prompt(10, 8)
    names = page_hashes(p, PS)
    store = make_backend(cfg.storage, cfg.layout)
    for bad in (torch.zeros(1, HYBRID.hidden_size), torch.zeros(2, 64, dtype=torch.float64)):
        rec = make_record(names[0], namespace_seed(None, None), p[:PS],
                          {STATE_POOL: bad}, fingerprint=cfg.layout.fingerprint)
        assert store.batch_set_v2([PoolTransfer(STATE_POOL, names[:1], [rec])]) == [[False]]
    assert store.stats()["refused/verification_failed"] == 2 and store.usage().records == 0


def test_namespaces_stay_isolated(model: Model) -> None:
    cfg = config()
    store = make_backend(cfg.storage, cfg.layout)
    p = prompt(11, 30)
    a = LocalEngine(cfg, storage=store)
    a.generate(Req(rid="a", input_ids=p, cache_salt="tenant-a", max_new_tokens=4))
    assert a.flush(10)
    fresh = LocalEngine(cfg, storage=store)   # same tokens, other tenant: L3 has a's only
    r = Req(rid="b", input_ids=p, cache_salt="tenant-b", max_new_tokens=4)
    out = fresh.generate(r)
    assert out.output_ids == reference(model, r)
    assert sum(out.cached_tokens.values()) == 0 and fresh.stats.get(STATE, "hit") == 0
    assert fresh.flush(10)
    # on a's engine, b finds none of a's radix pages, only its own in L3 (fresh wrote them)
    again = Req(rid="b2", input_ids=p, cache_salt="tenant-b", max_new_tokens=4)
    out = a.generate(again)
    assert out.output_ids == reference(model, again)
    assert out.cached_tokens["device"] == out.cached_tokens["host"] == 0
    assert out.cached_tokens["storage"] == 7 * PS
    for engine in (a, fresh):
        assert_clean(engine)
        engine.close()
