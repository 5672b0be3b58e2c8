"""Reads with no ``exists`` before them, the page index's hint (``l3_pages``) and writes
that skip what L3 holds, on the tiny model over a real memory backend."""

from __future__ import annotations

from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req
from pd_cache.core.sealing import Keyring
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage import make_backend
from pd_cache.storage.seal import SealedStorage, Sealer
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


def served(engine: LocalEngine, store: Wrapper, r: Req,
           l3_pages: int | None) -> tuple[list[int], int, dict[str, list[list[bytes]]]]:
    """The answer of a prefill given ``l3_pages`` then decode, its L3 tokens, and the keys
    of prefill's own L3 calls (its write-through included) by op."""
    out = engine.prefill(r, l3_pages)
    assert engine.flush(10)
    calls: dict[str, list[list[bytes]]] = {}
    for op, keys, _, _ in store.calls:
        calls.setdefault(op, []).append(keys)
    tokens = engine.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token,
                           out.state, out.page_names)
    assert engine.flush(10)
    return tokens, out.cached_tokens["storage"], calls


def recorded_engine() -> tuple[Wrapper, LocalEngine]:
    """An engine over a memory backend that records its calls; prefetch waits for all."""
    cfg = config(batch=16, policy="wait_complete")
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    return store, LocalEngine(cfg, storage=store)


def test_a_stale_hint_is_a_counted_miss_with_the_right_answer_and_no_exists() -> None:
    cfg = config(batch=4, policy="wait_complete")
    p = prompt(31, 42)                                   # 10 full pages, all usable
    names = page_hashes(p, PS)
    store = Wrapper(filled_store(cfg, [Req(rid="d", input_ids=p[:25], max_new_tokens=1)]))
    assert store.inner.batch_exists(names) == 6
    engine = LocalEngine(cfg, storage=store)
    r = Req(rid="r", input_ids=p, max_new_tokens=4)
    tokens, from_l3, calls = served(engine, store, r, l3_pages=9)  # says 9; L3 has 6
    assert tokens == reference(engine, r)
    assert from_l3 == 6 * PS
    assert calls["get"] == [names[:4], names[4:8], names[8:9]] and "exists" not in calls
    assert engine.stats.get(Event.MISS, MissReason.STALE_INDEX) == 3   # pages 6, 7, 8
    assert engine.stats.get(Event.MISS, MissReason.NOT_STORED) == 1    # page 9, not asked
    # the hint was wrong: the write starts where L3's copy ended, and L3 now has it all
    assert calls["set"] == [names[6:10]]
    assert store.inner.batch_exists(names) == 10
    assert_clean(engine)
    engine.close()


def test_a_hint_skips_the_write_of_what_l3_holds_and_no_hint_reads_without_exists() -> None:
    cfg = config(batch=4, policy="wait_complete")
    p = prompt(32, 41)
    names = page_hashes(p, PS)                           # 10 pages
    q = p[:40]                                           # 10 full pages, 9 usable
    for l3_pages in (10, None):
        store = Wrapper(filled_store(cfg, [Req(rid="d", input_ids=p, max_new_tokens=1)]))
        engine = LocalEngine(cfg, storage=store)
        r = Req(rid="r", input_ids=q, max_new_tokens=3)
        tokens, from_l3, calls = served(engine, store, r, l3_pages)
        assert tokens == reference(engine, r) and from_l3 == 9 * PS
        assert calls["get"] == [names[:4], names[4:8], names[8:9]] and "exists" not in calls
        # page 9 is never read (its last token is computed): L3 holds it, the hint says so
        assert calls.get("set", []) == ([] if l3_pages is not None else [names[9:10]])
        assert_clean(engine)
        engine.close()


def test_a_read_that_finds_nothing_takes_no_host_slot() -> None:
    cfg = config(batch=4, policy="wait_complete", host=10)
    engine = LocalEngine(cfg, storage=make_backend(cfg.storage, cfg.layout))
    engine.prefill(Req(rid="warm", input_ids=prompt(33, 41), max_new_tokens=1))
    held, missed = engine.cache.num_host_pages, engine.stats.get(Event.MISS,
                                                                  MissReason.NOT_STORED)
    assert held == 10                                    # L2 full
    p = prompt(34, 41)
    r = Req(rid="r", input_ids=p, max_new_tokens=1)
    fetched = engine.controller.reader.prefetch(r, page_hashes(p, PS))
    assert fetched.num_pages == 0 and engine.cache.num_host_pages == held   # none evicted
    assert engine.stats.get(Event.MISS, MissReason.NOT_STORED) - missed == 10
    fetched.release()
    assert engine.flush(10)
    engine.close()


def test_a_next_turn_asks_no_exists_anywhere_and_offload_sends_only_what_l3_lacks() -> None:
    store, engine = recorded_engine()
    first = Req(rid="t1", input_ids=prompt(35, 42), max_new_tokens=9)
    engine.generate(first)
    assert engine.flush(10)
    store.calls.clear()
    turn = Req(rid="t2", input_ids=first.input_ids + first.output_ids + prompt(36, 13),
               max_new_tokens=5)
    out = engine.prefill(turn)
    names = out.page_names
    assert out.l3_pages == len(names)       # this worker wrote the hit; the rest it writes
    tokens = engine.decode(turn, out.kv_pages, out.num_prompt_tokens, out.first_token,
                           out.state, names, out.l3_pages)
    assert engine.flush(10)
    assert tokens == reference(engine, turn)
    assert [op for op, *_ in store.calls] == ["get", "set", "set"]   # read, write, offload
    offload = store.calls[-1][1]
    assert offload[0] not in names           # generated pages only: the prompt is in L3
    assert store.inner.batch_exists(list(names) + offload) == len(names) + len(offload)
    # what a worker cannot vouch for, decode sends: past the pages the index or it knows
    ctl = engine.controller
    other = page_hashes(prompt(37, 41), PS)
    assert ctl.held_after(other, 3, None) == 0
    assert ctl.held_after(other, 3, 2) == 2 and ctl.held_after(other, 3, 3) == len(other)
    assert ctl.held_after(other, 3, 3, stale=True) == 0
    assert_clean(engine)
    engine.close()


def test_decode_offload_starts_where_prefill_said_l3_ends_without_asking() -> None:
    store, engine = recorded_engine()
    r = Req(rid="r", input_ids=prompt(38, 42), max_new_tokens=9)
    out = engine.prefill(r)
    assert engine.flush(10)
    store.calls.clear()
    engine.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token, out.state,
                  out.page_names, 7)                                   # L3 holds 7 of 10
    assert engine.flush(10)
    [(op, keys, _, prefix)] = store.calls
    assert op == "set" and keys[:3] == list(out.page_names[7:]) and prefix == \
        list(out.page_names[:7])
    assert r.output_ids == reference(engine, r)
    assert_clean(engine)
    engine.close()


def test_a_record_that_does_not_open_is_one_miss_by_its_reason_not_also_absent() -> None:
    cfg = config(batch=4, policy="wait_complete")
    inner = make_backend(cfg.storage, cfg.layout)
    p = prompt(35, 41)                                   # 10 full pages
    writer = LocalEngine(cfg, storage=SealedStorage(inner, Sealer(Keyring.random())))
    writer.prefill(Req(rid="w", input_ids=p, max_new_tokens=1))
    assert writer.flush(10) and inner.batch_exists(page_hashes(p, PS)) == 10
    thief = SealedStorage(inner, Sealer(Keyring.random()))   # another secret: tags fail
    engine = LocalEngine(cfg, storage=thief)
    r = Req(rid="r", input_ids=p, max_new_tokens=3)
    out = engine.prefill(r)
    assert out.cached_tokens["storage"] == 0
    assert thief.stats()["miss/verification_failed"] == 4       # the first batch's records
    # the prompt's pages are counted once, by why they were lost: none as "not stored"
    assert engine.stats.get(Event.MISS, MissReason.VERIFICATION_FAILED) == 10
    assert engine.stats.get(Event.MISS, MissReason.NOT_STORED) == 0
    assert engine.flush(10)
    for e in (writer, engine):
        e.close()


def test_a_hit_whose_write_is_still_queued_is_not_offloaded_again() -> None:
    cfg = config(batch=16, policy="wait_complete")
    store = SetGate(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store)
    head = prompt(39, 40)                                # 10 pages, computed by the first
    first = engine.prefill(Req(rid="a", input_ids=head + prompt(40, 9), max_new_tokens=1))
    r = Req(rid="b", input_ids=head + prompt(41, 9), max_new_tokens=5)
    out = engine.prefill(r)                              # a's write-through not landed yet
    assert out.cached_tokens["device"] == 40
    assert out.l3_pages == len(out.page_names)           # queued before b's own write
    engine.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token, out.state,
                  out.page_names, out.l3_pages)
    store.gate.set()
    assert engine.flush(10) and r.output_ids == reference(engine, r)
    written = [keys for op, keys, *_ in store.calls if op == "set"]
    assert written[0] == list(first.page_names) and written[1] == list(out.page_names[10:])
    assert not set(written[2]) & set(out.page_names)     # decode: generated pages only
    assert store.inner.batch_exists(list(out.page_names)) == len(out.page_names)
    assert_clean(engine)
    engine.close()


def test_a_turn_read_partly_from_l3_vouches_for_what_it_read() -> None:
    cfg = config(batch=128, policy="wait_complete")
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    prefill, decode = LocalEngine(cfg, storage=store), LocalEngine(cfg, storage=store)
    ids = prompt(42, 40)
    for turn in range(3):                                # decode offloads each answer page
        r = Req(rid=f"t{turn}", input_ids=ids + prompt(43 + turn, 12), max_new_tokens=5)
        out = prefill.prefill(r)   # turns 1, 2: one get of the rest reads the answer's page
        assert out.cached_tokens["storage"] == (PS if turn else 0)
        assert out.l3_pages == len(out.page_names)       # it wrote or read every one
        ids = r.input_ids + decode.decode(r, out.kv_pages, out.num_prompt_tokens,
                                          out.first_token, out.state, out.page_names,
                                          out.l3_pages)
        assert prefill.flush(10) and decode.flush(10)
        assert ids[len(r.input_ids):] == reference(decode, r)
    assert decode.stats.get("offload", "prompt") == 0    # decode wrote no prompt page again
    assert store.inner.batch_exists(page_hashes(ids, PS)) == (len(ids) - 1) // PS
    for engine in (prefill, decode):
        assert_clean(engine)
        engine.close()
