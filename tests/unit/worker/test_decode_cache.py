"""Decode's prefix cache in one process (no Ray): a conversation's next turn is handed only
the pages decode lacks, its answer equals the model's without a cache, and a lost or
mismatched reservation is refilled, never trusted."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import msgspec
import pytest

from pd_cache.core.config import CacheConfig, PDCacheConfig
from pd_cache.core.model_config import ModelConfig
from pd_cache.core.request import Req
from pd_cache.kv import CacheKey
from pd_cache.model.model import Model, reference_generate
from pd_cache.storage import make_backend
from pd_cache.worker.workers import DecodeWorker, PrefillWorker
from tests.unit.tiering.fakes import PS, SMALL, prompt
from tests.unit.worker.handoff import clean, turn

HYBRID = dataclasses.replace(SMALL, model=ModelConfig.preset("tiny-hybrid"),
                             cache=dataclasses.replace(SMALL.cache, state_every_pages=2))


def after_a_first_turn(seeds: tuple[int, int], lengths: tuple[int, int]
                       ) -> tuple[Any, PrefillWorker, DecodeWorker, Req]:
    """An L3, workers sharing it after a first turn of ``lengths[0]`` tokens and 8
    answered, and the second turn's request (``lengths[1]`` new tokens, 4 to answer)."""
    storage = make_backend(SMALL.storage, SMALL.layout)
    p, d = PrefillWorker(SMALL, storage=storage), DecodeWorker(SMALL, storage=storage)
    one = Req(rid="t1", input_ids=prompt(seeds[0], lengths[0]), max_new_tokens=8)
    out1, _ = turn(p, d, one)
    ids = one.input_ids + out1.output_ids + prompt(seeds[1], lengths[1])
    return storage, p, d, Req(rid="t2", input_ids=ids, max_new_tokens=4)


@pytest.mark.parametrize("cfg", [SMALL, HYBRID], ids=["plain", "hybrid"])
def test_a_second_turn_hands_off_only_the_new_pages(cfg: PDCacheConfig) -> None:
    model = Model(cfg.model)
    storage = make_backend(cfg.storage, cfg.layout)
    p, d = PrefillWorker(cfg, storage=storage), DecodeWorker(cfg, storage=storage)
    one = Req(rid="t1", input_ids=prompt(1, 19), cache_salt="a", max_new_tokens=9)
    out1, info1 = turn(p, d, one)
    assert info1.kept_pages == 0 and out1.output_ids == reference_generate(model, one).output_ids
    two = Req(rid="t2", input_ids=one.input_ids + out1.output_ids + prompt(2, 6),
              cache_salt="a", max_new_tokens=5)
    out2, info2 = turn(p, d, two)
    held = (19 + 9 - 1) // PS   # prompt + answer but its last token, whole pages
    assert info2.kept_pages == out2.pages_kept == held
    assert out2.pages_received == info2.num_kv_pages - held == -(-(19 + 9 + 6) // PS) - held
    assert out2.output_ids == reference_generate(model, two).output_ids
    stats = d.engine_stats()
    assert stats["keep/reserved"] == stats["keep/kept"] == held
    # another namespace holds nothing here: no reservation, the whole prompt handed off
    other = msgspec.structs.replace(two, rid="t3", cache_salt="b")
    assert d.reserve(other) == 0
    out3, _ = turn(p, d, other)
    assert out3.output_ids == out2.output_ids and out3.pages_kept == 0
    clean(p, d)
    for w in (p, d):
        w.close()


def test_a_lost_or_mismatched_reservation_is_refilled() -> None:
    model = Model(SMALL.model)
    storage, p, d, two = after_a_first_turn((3, 4), (17, 3))
    want = reference_generate(model, two).output_ids
    kept = d.reserve(two)
    assert kept == (17 + 8 - 1) // PS and d.state().locks == 1
    # the reservation is gone (a restart, a timeout): decode's own tiers refill the gap
    assert d.release("t2") and d.state().locks == 0
    info, pages, _ = p.prefill(two, kept)
    assert d.decode(two, info, pages).output_ids == want
    # a seam that does not line up (prefill named the pages otherwise): refilled too
    # (the prompt's whole pages are held by now: turn 2 itself went through decode)
    whole = d.reserve(two)
    assert whole == len(two.input_ids) // PS > kept
    info, pages, _ = p.prefill(two, whole)
    bad = msgspec.structs.replace(info, page_names=(b"x" * 16,) + info.page_names[1:])
    assert d.decode(two, bad, pages).output_ids == want
    # a decode worker that restarted: cold, it reserves nothing and fills the gap itself
    cold = DecodeWorker(SMALL, storage=storage)
    assert cold.reserve(two) == 0
    assert cold.decode(two, info, pages).output_ids == want
    stats, cold_stats = d.engine_stats(), cold.engine_stats()
    assert stats["keep/lost"] == stats["keep/seam_mismatch"] == 1
    assert stats["keep/refilled"] == kept + whole and "keep/kept" not in stats
    assert cold_stats["keep/lost"] == 1 and cold_stats["keep/refilled"] == whole
    clean(p, d, cold)
    for w in (p, d, cold):
        w.close()


def test_off_switch_and_eviction_within_decode_pools() -> None:
    off = dataclasses.replace(SMALL, cache=dataclasses.replace(SMALL.cache, decode_cache=False))
    assert CacheConfig().decode_cache and not off.cache.decode_cache
    p, d = PrefillWorker(SMALL), DecodeWorker(off)
    one = Req(rid="t1", input_ids=prompt(5, 13), max_new_tokens=6)
    out1, _ = turn(p, d, one)
    assert d.reserve(one) == 0 and d.state().pool_usage["device"] == {}
    # on, with decode pools smaller than what passes through: LRU eviction, no leak
    small = dataclasses.replace(SMALL, cache=dataclasses.replace(SMALL.cache, device_pages=6,
                                                                 host_pages=4))
    d2 = DecodeWorker(small)
    model = Model(SMALL.model)
    for i in range(4):
        r = Req(rid=f"e{i}", input_ids=prompt(10 + i, 21), max_new_tokens=4)
        out, _ = turn(p, d2, r)
        assert out.output_ids == reference_generate(model, r).output_ids
    usage = d2.state().pool_usage
    assert usage["device"].get("radix", 0) <= 6 and usage["host"].get("radix", 0) <= 4
    assert d2.reserve(r) == 21 // PS   # the latest sequence is the one kept
    assert d2.release(r.rid)
    clean(p, d, d2)
    for w in (p, d, d2):
        w.close()


def test_prefill_asks_how_much_decode_kept_once_the_prompt_is_computed() -> None:
    """``prefill(req, fn)``: ``fn`` (the reservation under way on decode) is called once,
    after the prompt's pages are computed and cached; an answer that is not a page count of
    the prompt hands over the whole prompt."""
    model = Model(SMALL.model)
    p, d = PrefillWorker(SMALL), DecodeWorker(SMALL)
    one = Req(rid="t1", input_ids=prompt(6, 17), max_new_tokens=8)
    out1, _ = turn(p, d, one)
    two = Req(rid="t2", input_ids=one.input_ids + out1.output_ids + prompt(7, 3),
              max_new_tokens=4)
    key = CacheKey.for_request(two, page_size=PS, algo=SMALL.cache.hash_algo)
    prefilled: list[int] = []

    def reservation() -> int:
        prefilled.append(p.engine.cache.match_prefix(key).num_pages)
        return d.reserve(two)
    info, pages, _ = p.prefill(two, reservation)
    assert prefilled == [len(two.input_ids) // PS]
    assert info.kept_pages == (17 + 8 - 1) // PS and pages.shape[0] == info.sent_pages
    assert d.decode(two, info, pages).output_ids == reference_generate(model, two).output_ids
    for wrong in (10**6, -1, True, None):
        info, pages, _ = p.prefill(two, lambda: wrong)   # noqa: B023 - called right here
        assert info.kept_pages == 0 and pages.shape[0] == info.num_kv_pages
    clean(p, d)
    for w in (p, d):
        w.close()


def test_a_first_turn_reserves_the_system_prompt_of_a_turn_still_decoding() -> None:
    """Client A's prompt enters decode's cache when its handoff is joined: client B of the
    same tenant, whose reservation came while A's handoff was on its way, waits for it and
    reserves the shared system prompt while A still decodes; both answers are the model's."""
    model = Model(SMALL.model)
    p, d = PrefillWorker(SMALL), DecodeWorker(SMALL)
    system = prompt(8, 4 * PS)
    a = Req(rid="a", input_ids=system + prompt(9, 7), cache_salt="t", max_new_tokens=6)
    b = Req(rid="b", input_ids=system + prompt(10, 5), cache_salt="t", max_new_tokens=6)
    info_a, pages_a, _ = p.prefill(a)
    d.expect(a.rid, info_a.page_names)        # A's handoff is on its way
    c = msgspec.structs.replace(b, rid="c")   # reserves, then is released while it waits
    kept: dict[str, int] = {}
    reserving = [threading.Thread(target=lambda r=r: kept.update({r.rid: d.reserve(r)}))
                 for r in (b, c)]
    for t in reserving:
        t.start()
    for _ in range(1000):                     # a bounded wait: the thread is starting
        if "c" in d.keeper._asked:
            break
        reserving[1].join(0.01)
    assert d.release("c") is False            # nothing locked yet: it waits for A
    decoding = d.decode_stream(a, info_a, pages_a)
    tokens = [next(decoding)]                 # A joined and decoding
    for t in reserving:
        t.join()
    assert kept == {"b": 4, "c": 0} and d.state().locks == 1
    info_b, pages_b, _ = p.prefill(b, kept["b"])
    assert pages_b.shape[0] == info_b.num_kv_pages - 4
    out_b = d.decode(b, info_b, pages_b)
    *rest, out_a = decoding
    want_a = reference_generate(model, a).output_ids
    assert [info_a.first_token, *tokens, *rest] == out_a.output_ids == want_a
    assert out_b.pages_kept == 4 and out_b.output_ids == reference_generate(model, b).output_ids
    # pages that cannot be held (names that do not fit the prompt) fail nothing
    d.expect("z", info_a.page_names)
    d.hold(msgspec.structs.replace(a, rid="z"), pages_a, [b"x" * 16] * 99)
    assert not d.keeper._incoming
    clean(p, d)
    for w in (p, d):
        w.close()


def test_a_handoff_that_does_not_fit_is_refused_its_reservation_freed_nothing_kept() -> None:
    model = Model(SMALL.model)
    _, p, d, two = after_a_first_turn((5, 6), (17, 9))
    usage = d.state().pool_usage
    kept = d.reserve(two)
    info, pages, _ = p.prefill(two, kept)
    assert kept and info.sent_pages == pages.shape[0] >= 2 and d.state().locks == 1
    with pytest.raises(ValueError, match="handoff: expected dtype torch.float32, got "
                                         "torch.float16"):
        d.decode(two, info, pages.half())
    assert d.state().locks == 0 and d.state().pool_usage == usage
    assert d.reserve(two) == kept
    with pytest.raises(ValueError, match=rf"handoff: {info.sent_pages - 1} pages for the "
                                         rf"{info.sent_pages} after the {kept} kept"):
        d.decode(two, info, pages[1:])
    assert d.state().locks == 0 and d.state().pool_usage == usage
    # the same turn handed off whole decodes as the model does, from what decode kept
    out2, info2 = turn(p, d, two)
    assert info2.kept_pages == kept and out2.pages_kept == kept
    assert out2.output_ids == reference_generate(model, two).output_ids
    clean(p, d)
    for w in (p, d):
        w.close()
