"""CacheController against a real MemoryBackend (wrapped to record calls or inject faults).

Central checks: output with pages loaded from L3 equals the no-cache output whatever L3
does; every prefetch slot is freed once; one ack per batch issued; prefix_keys arrive in
their three states and are never mutated after they were handed over.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest
import torch

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req
from pd_cache.core.vocab import PREFETCH_ACK, PREFETCH_BATCH, Event, MissReason
from pd_cache.storage import make_backend
from pd_cache.tiering.controller import CacheController
from pd_cache.worker.engine import LocalEngine
from tests.unit.processes import thread_nices
from tests.unit.tiering.fakes import (
    PS,
    Delayed,
    Faulty,
    SetGate,
    Wrapper,
    assert_clean,
    config,
    filled_store,
    prompt,
    reference,
)


def acks(engine: LocalEngine) -> int:
    return engine.stats.get(PREFETCH_ACK, "ok") + engine.stats.get(PREFETCH_ACK, "short")


# -- prefix_keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["off", "empty", "names"])
def test_prefix_keys_reach_every_call_in_their_three_states(state: str) -> None:
    cfg = config(batch=3, prefix_keys=state != "off")
    p = prompt(1, 42)
    names = page_hashes(p, PS)
    store = Wrapper(filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)]))
    engine = LocalEngine(cfg, storage=store)
    if state == "names":      # a local hit of 2 pages: L3 calls start after them
        engine.prefill(Req(rid="warm", input_ids=p[:9], max_new_tokens=1))
        assert engine.flush(10)
    store.calls.clear()
    out = engine.prefill(Req(rid="r", input_ids=p, max_new_tokens=1))
    assert engine.flush(10)
    assert out.cached_tokens["storage"] == (10 if state != "names" else 8) * PS
    gets = [names.index(keys[0]) for op, keys, *_ in store.calls if op == "get"]
    assert gets == ([0, 3, 6, 9] if state != "names" else [2, 5, 8])
    for op, keys, info, copy in store.calls:
        start = names.index(keys[0])
        assert info is not None and info.request_id == "r"
        if state == "off":
            assert info.prefix_keys is None
            continue
        # the list handed over still holds what it held then, and names the chain before
        assert list(info.prefix_keys) == copy == names[:start], (op, start)
        assert info.namespace_seed is not None
    if state == "empty":
        assert store.calls[0][3] == []
    engine.close()


# -- prefetch faults --------------------------------------------------------------------------

@pytest.mark.parametrize("mode,victim,landed", [
    ("short", 4, 4), ("missing_middle", 5, 5), ("corrupt", 3, 3), ("raises", 6, 6),
])
def test_prefetch_faults_fall_back_to_recompute(mode: str, victim: int, landed: int) -> None:
    cfg = config(batch=3)
    p = prompt(2, 42)                                  # 10 usable pages: batches 3+3+3+1
    store = filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)])
    names = page_hashes(p, PS)
    faulty = Faulty(store, mode, names[victim])
    engine = LocalEngine(cfg, storage=faulty)
    r = Req(rid="r", input_ids=p, max_new_tokens=4)
    result = engine.generate(r)
    assert result.output_ids == reference(engine, r)
    # "raises" loses its whole batch (pages 6-8); the others keep the pages before the fault
    want = landed if mode != "raises" else 6
    assert result.cached_tokens["storage"] == want * PS
    assert acks(engine) == engine.stats.get(PREFETCH_BATCH) == 4
    assert engine.stats.get(PREFETCH_ACK, "ok") == want // 3
    reason = {"short": MissReason.NOT_STORED, "missing_middle": MissReason.NOT_STORED,
              "corrupt": MissReason.VERIFICATION_FAILED,
              "raises": MissReason.STORAGE_ERROR}[mode]
    assert engine.stats.get(Event.MISS, reason) > 0
    assert_clean(engine)
    engine.close()


def test_a_call_that_times_out_is_a_miss_and_the_request_completes() -> None:
    cfg = config(batch=3, policy="wait_complete")
    p = prompt(3, 42)
    store = filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)])
    names = page_hashes(p, PS)
    slow = Delayed(store, {names[3]})                  # the 2nd batch never answers
    engine = LocalEngine(cfg, storage=slow, storage_timeout_s=0.2)
    r = Req(rid="r", input_ids=p, max_new_tokens=4)
    result = engine.generate(r)
    assert result.output_ids == reference(engine, r)
    assert result.cached_tokens["storage"] == 3 * PS
    # the read stopped at the 2nd batch: its 3 pages and the 4 after it, under its reason
    assert engine.stats.get(Event.MISS, MissReason.TIMEOUT) == 7
    assert acks(engine) == engine.stats.get(PREFETCH_BATCH) == 4
    slow.gate.set()
    assert_clean(engine)
    engine.close()


# -- policies ---------------------------------------------------------------------------------

def late(cfg: PDCacheConfig, p: list[int], page: int, after_s: float) -> Delayed:
    """A store holding prompt ``p`` whose batch starting at ``page`` answers ``after_s``
    seconds from now."""
    store = filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)])
    slow = Delayed(store, {page_hashes(p, PS)[page]})
    threading.Timer(after_s, slow.gate.set).start()
    return slow


def test_wait_complete_waits_for_every_batch() -> None:
    cfg = config(batch=3, policy="wait_complete")
    p = prompt(4, 42)
    slow = late(cfg, p, 6, 0.2)
    engine = LocalEngine(cfg, storage=slow)
    result = engine.generate(Req(rid="r", input_ids=p, max_new_tokens=2))
    assert result.cached_tokens["storage"] == 10 * PS
    assert "result-before-done" in slow.log            # it did wait on the late batch
    assert_clean(engine)
    engine.close()


def test_timeout_gives_up_at_its_bound_and_uses_what_arrived() -> None:
    cfg = config(batch=3, policy="timeout", prefetch_timeout_base_s=0.05,
                 prefetch_timeout_per_1k_tokens_s=0.0, prefetch_timeout_max_s=0.1)
    p = prompt(5, 42)
    store = filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)])
    names = page_hashes(p, PS)
    slow = Delayed(store, {names[6]})
    engine = LocalEngine(cfg, storage=slow)
    r = Req(rid="r", input_ids=p, max_new_tokens=3)
    result = engine.generate(r)
    assert result.cached_tokens["storage"] == 6 * PS   # batches 1 and 2 arrived
    assert result.output_ids == reference(engine, r)
    assert engine.stats.get(Event.MISS, MissReason.TIMEOUT) == 3 + 1   # batch 3, and 4's
    slow.gate.set()
    assert_clean(engine)
    engine.close()


def test_timeout_bound_grows_per_1k_tokens_and_is_capped() -> None:
    cfg = config(policy="timeout", prefetch_timeout_base_s=0.1,
                 prefetch_timeout_per_1k_tokens_s=0.2, prefetch_timeout_max_s=0.5)
    store = make_backend(cfg.storage, cfg.layout)
    engine = LocalEngine(cfg, storage=store)
    ctl = engine.controller
    now = time.monotonic()
    assert ctl.reader.deadline("best_effort", 1000) is None
    assert ctl.reader.deadline("timeout", 1000) - now == pytest.approx(0.3, abs=0.05)
    assert ctl.reader.deadline("timeout", 10_000) - now == pytest.approx(0.5, abs=0.05)
    assert ctl.reader.deadline("wait_complete", 10) - now == pytest.approx(30.0, abs=0.05)
    engine.close()


def test_best_effort_never_waits() -> None:
    cfg = config(batch=3, policy="best_effort")
    p = prompt(6, 42)
    store = filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)])
    names = page_hashes(p, PS)
    slow = Delayed(store, {names[3]})
    engine = LocalEngine(cfg, storage=slow)
    r = Req(rid="r", input_ids=p, max_new_tokens=3)
    result = engine.generate(r)
    assert result.cached_tokens["storage"] == 3 * PS   # what had arrived: batch 1
    assert "result-before-done" not in slow.log
    assert result.output_ids == reference(engine, r)
    slow.gate.set()
    assert_clean(engine)
    engine.close()


def test_best_effort_waits_as_timeout_for_pages_a_page_index_vouches_for() -> None:
    cfg = config(batch=3, policy="best_effort", prefetch_timeout_base_s=2.0)
    p = prompt(6, 42)
    slow = late(cfg, p, 3, 0.1)
    engine = LocalEngine(cfg, storage=slow)
    r = Req(rid="r", input_ids=p, max_new_tokens=3)
    out = engine.prefill(r, l3_pages=10)                # the index: L3 holds 10 pages
    assert out.cached_tokens["storage"] == 10 * PS      # the late batch was waited for
    assert "result-before-done" in slow.log
    assert engine.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token, out.state,
                         out.page_names, out.l3_pages) == reference(engine, r)
    assert engine.flush(10)
    assert_clean(engine)
    engine.close()


# -- namespace, host room, backup -------------------------------------------------------------

def test_a_prefetch_under_another_namespace_is_refused_and_the_worker_keeps_serving() -> None:
    cfg = config()
    p = prompt(7, 30)
    store = filled_store(cfg, [Req(rid="d", input_ids=p, cache_salt="a", max_new_tokens=1)])
    engine = LocalEngine(cfg, storage=store)
    r = Req(rid="r", input_ids=p, cache_salt="b", max_new_tokens=1)
    other = page_hashes(p, PS, cache_salt="a")
    # A caller bug hands b's request a's names: L3 checks them against the request's own
    # namespace seed (prefix_keys=[]: the chain starts there), refuses, and nothing lands.
    fetched = engine.controller.reader.prefetch(r, other[:5])
    assert fetched.num_pages == 0
    assert store.stats()["miss/namespace_refused"] == 1
    assert engine.stats.get(Event.MISS, MissReason.NOT_STORED) == 5
    assert engine.pool_usage()["host"] == {}
    ok = Req(rid="ok", input_ids=p, cache_salt="a", max_new_tokens=3)
    served = engine.generate(ok)
    assert served.cached_tokens["storage"] == (len(p) - 1) // PS * PS
    assert served.output_ids == reference(engine, ok)
    assert_clean(engine)
    engine.close()


def test_prefetch_lands_in_host_slots_and_evicts_l2_for_room() -> None:
    cfg = config(batch=4, host=6)
    p = prompt(8, 42)
    store = filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)])
    engine = LocalEngine(cfg, storage=store)
    engine.prefill(Req(rid="other", input_ids=prompt(9, 25), max_new_tokens=1))
    assert engine.host_pool.num_free == 0                 # L2 full of another prompt
    r = Req(rid="r", input_ids=p, max_new_tokens=3)
    result = engine.generate(r)
    assert result.cached_tokens["storage"] == 6 * PS      # bounded by the host pool
    assert result.output_ids == reference(engine, r)
    assert_clean(engine)
    engine.close()


def test_backup_runs_off_the_request_path_and_flush_waits() -> None:
    cfg = config(batch=3)
    store = SetGate(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store)
    p = prompt(10, 42)
    out = engine.prefill(Req(rid="r", input_ids=p, max_new_tokens=1))   # returns at once
    assert out.cached_tokens["storage"] == 0
    assert engine.flush(timeout=0.05) is False          # the write is still held back
    store.gate.set()
    assert engine.flush(timeout=10)
    assert store.inner.batch_exists(page_hashes(p, PS)) == len(p) // PS
    assert engine.stats.get("backup", "page") == len(p) // PS
    engine.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("write_nice", [10, 0])
def test_backup_writes_run_at_the_write_nice_and_the_caller_keeps_its_own(
        write_nice: int) -> None:
    cfg = config(batch=3, write_nice=write_nice)
    setters: list[int] = []

    class SetThreads(Wrapper):
        def batch_set_v2(self, transfers, extra_info=None):
            setters.append(threading.get_native_id())
            return super().batch_set_v2(transfers, extra_info)

    store = SetThreads(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store)
    own = thread_nices()[threading.get_native_id()]
    p = prompt(13, 42)
    engine.prefill(Req(rid="r", input_ids=p, max_new_tokens=1))
    assert engine.flush(10)
    assert store.inner.batch_exists(page_hashes(p, PS)) == len(p) // PS   # nothing lost
    assert len(set(setters)) == 1 and setters[0] != threading.get_native_id()
    nices = thread_nices()
    assert nices[setters[0]] == max(own, write_nice)
    assert nices[threading.get_native_id()] == own
    engine.close()


def test_a_failed_backup_batch_stops_that_backup_and_is_counted() -> None:
    cfg = config(batch=3)
    p = prompt(11, 42)
    names = page_hashes(p, PS)
    store = SetGate(make_backend(cfg.storage, cfg.layout), refuse=names[4])
    store.gate.set()
    engine = LocalEngine(cfg, storage=store)
    engine.prefill(Req(rid="r", input_ids=p, max_new_tokens=1))
    assert engine.flush(10)
    assert store.inner.batch_exists(names) == 3
    sets = [keys for op, keys, *_ in store.calls if op == "set"]
    assert len(sets) == 2                                # the third batch was never sent
    assert engine.stats.get("backup", "failed_batch") == 1
    assert engine.stats.get("backup", "page") == 3
    engine.close()


def test_controller_refuses_bad_arguments() -> None:
    cfg = config()
    engine = LocalEngine(cfg)
    with pytest.raises(ValueError, match="storage"):
        CacheController(object(), engine.host_pool, cfg.storage)  # type: ignore[arg-type]
    store = make_backend(cfg.storage, cfg.layout)
    with pytest.raises(ValueError, match="call_timeout_s"):
        CacheController(store, engine.host_pool, cfg.storage, call_timeout_s=0)
    ctl = CacheController(store, engine.host_pool, cfg.storage)
    r = Req(rid="r", input_ids=prompt(12, 20))
    with pytest.raises(ValueError, match="backup"):
        ctl.writer.backup(r, page_hashes(r.input_ids, PS)[:2], r.input_ids[:5],
                   torch.zeros((2, *cfg.layout.page_shape)))
    ctl.close()
    disabled = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, enabled=False))
    assert LocalEngine(disabled, storage=store).controller is None
    engine.close()
