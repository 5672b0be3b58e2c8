"""DecodeOffloadManager: decode writes the names a prefill of ``prompt + output`` computes,
and the next turn of a conversation finds them in L3 and still produces the same output."""

from __future__ import annotations

import pytest

from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.vocab import GENERATED, OFFLOAD, PROMPT
from pd_cache.storage import make_backend
from pd_cache.tiering.offload import DecodeOffloadManager
from pd_cache.worker.engine import LocalEngine
from tests.unit.tiering.fakes import PS, Wrapper, assert_clean, config, prompt, reference

NAMESPACES = [(None, None), ("lora-1", None), (None, "tenant-a"), ("lora-1", "tenant-a")]


def req(rid: str, ids: list[int], ns: tuple[str | None, str | None], n: int) -> Req:
    return Req(rid=rid, input_ids=ids, extra_key=ns[0], cache_salt=ns[1], max_new_tokens=n)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_decode_names_equal_page_hashes_of_the_full_sequence(ns: tuple) -> None:
    cfg = config(batch=4)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    prefill_side, decode_side = LocalEngine(cfg), LocalEngine(cfg, storage=store)
    r = req("r", prompt(20, 23), ns, 14)
    out = prefill_side.prefill(r)
    decode_side.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
    assert decode_side.flush(10)
    seq = r.input_ids + r.output_ids
    # every token but the last drawn has KV: 23 + 14 - 1 = 36 tokens = 9 pages
    want = page_hashes(seq, PS, extra_key=ns[0], cache_salt=ns[1])[:(len(seq) - 1) // PS]
    written = [k for op, keys, *_ in store.calls if op == "set" for k in keys]
    assert written == want
    assert store.inner.batch_exists(want) == len(want) == 9
    assert decode_side.stats.get(OFFLOAD, "page") == 9
    # 23 prompt tokens: 5 full prompt pages, then 4 pages that hold generated tokens
    assert decode_side.stats.get(OFFLOAD, PROMPT) == 5
    assert decode_side.stats.get(OFFLOAD, GENERATED) == 4
    # the manager reads the namespace from the request itself
    assert compute_prefix_hash(r, seq, page_size=PS) == page_hashes(
        seq, PS, extra_key=ns[0], cache_salt=ns[1])
    prefill_side.close()
    decode_side.close()


def test_the_next_turn_finds_the_answer_pages_and_matches_no_cache_output() -> None:
    cfg = config(batch=4)
    store = make_backend(cfg.storage, cfg.layout)
    ns = ("lora-1", "tenant-a")
    turn1 = req("t1", prompt(21, 26), ns, 12)
    first = LocalEngine(cfg, storage=store)
    first.generate(turn1)
    assert first.flush(10)
    first.close()
    ids = turn1.input_ids + turn1.output_ids + prompt(22, 7)
    turn2 = req("t2", ids, ns, 6)
    fresh = LocalEngine(cfg, storage=store)                  # empty device and host
    result = fresh.generate(turn2)
    assert result.output_ids == reference(fresh, turn2)
    # 26 + 12 - 1 = 37 tokens had KV in turn 1: 9 pages, 2 beyond the prompt's 6
    assert result.cached_tokens == {"device": 0, "host": 0, "storage": 9 * PS}
    assert fresh.flush(10)
    assert_clean(fresh)
    fresh.close()


def test_offload_writes_only_prompt_pages_l3_lacks_and_respects_stride() -> None:
    cfg = config(batch=8)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    prefill_side = LocalEngine(cfg, storage=store)
    decode_side = LocalEngine(cfg, storage=store, offload_stride=3 * PS)
    r = req("r", prompt(23, 20), (None, "t"), 17)
    out = prefill_side.prefill(r)                           # writes the 5 prompt pages
    assert prefill_side.flush(10)
    store.calls.clear()
    decode_side.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
    assert decode_side.flush(10)
    sets = [len(keys) for op, keys, *_ in store.calls if op == "set"]
    # 20 + 17 - 1 = 36 tokens: pages 5..8 are new; stride 12 tokens -> 3 pages, then 1
    assert sets == [3, 1]
    assert decode_side.stats.get(OFFLOAD, PROMPT) == 0       # prefill had written them all
    assert decode_side.stats.get(OFFLOAD, GENERATED) == 4
    prompt_names = page_hashes(r.input_ids, PS, cache_salt="t")
    assert not any(k in prompt_names for op, keys, *_ in store.calls if op == "set"
                   for k in keys)
    prefill_side.close()
    decode_side.close()


# A 10-token prompt (2 full pages, sent with the first write) decoded to 30 tokens at page
# size 4: {tokens with KV: generated pages sent then}; the call at 30 is the final one.
STRIDES = [
    (None, {30: 5}),                               # default: 8 pages; here only the final call
    (PS, {12: 1, 16: 1, 20: 1, 24: 1, 28: 1}),     # one page, as each page fills
    (1, {12: 1, 16: 1, 20: 1, 24: 1, 28: 1}),      # never before a page is full
    (6, {14: 1, 18: 1, 22: 1, 26: 1, 30: 1}),      # 6 tokens past the last page written
    (12, {20: 3, 30: 2}),                          # 3 pages at once; final sends the rest
    (100, {30: 5}),                                # only the final call
]


@pytest.mark.parametrize("stride, sent_at", STRIDES, ids=[str(s) for s, _ in STRIDES])
def test_stride_sets_when_generated_pages_are_offloaded(stride: int | None,
                                                        sent_at: dict[int, int]) -> None:
    cfg = config(batch=8)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store)
    manager = DecodeOffloadManager(engine.controller, stride=stride)
    ns = ("lora-1", "tenant-a")
    seq = prompt(25, 30)
    kv = engine.model(seq).kv                      # the KV decode holds, token by token
    state = manager.offload_kv_cache(req("r", seq[:10], ns, 20))
    assert engine.flush(10)
    assert not store.calls                         # nothing sent before the first write
    sent = {n: manager.advance(state, seq[:n], kv, n, final=n == 30) for n in range(11, 31)}
    assert {n: pages for n, pages in sent.items() if pages} == sent_at
    assert engine.flush(10)
    writes = [keys for op, keys, *_ in store.calls if op == "set"]
    # one write per send, the first led by the prompt's 2 pages (L3 had none of them)
    assert [len(keys) for keys in writes] == [2 + list(sent_at.values())[0],
                                              *list(sent_at.values())[1:]]
    # the prompt's 2 full pages, then the 5 after them (tokens 28-29 never fill a page)
    names = page_hashes(seq, PS, extra_key=ns[0], cache_salt=ns[1])
    assert [k for keys in writes for k in keys] == names[:7] == state.names
    assert engine.stats.get(OFFLOAD, PROMPT) == 2
    assert engine.stats.get(OFFLOAD, GENERATED) == 5
    engine.close()


def test_a_prompt_without_generated_pages_is_still_written_at_the_end() -> None:
    """``final`` writes the prompt's pages L3 lacks even when no generated page filled
    (a request that ends at once, or is dropped early)."""
    cfg = config(batch=8)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store)
    manager = DecodeOffloadManager(engine.controller)
    seq = prompt(26, 14)
    kv = engine.model(seq).kv
    state = manager.offload_kv_cache(req("r", seq[:13], (None, "t"), 1))
    assert manager.advance(state, seq[:14], kv, 14) == 0       # no page filled: nothing yet
    assert engine.flush(10) and not store.calls
    assert manager.advance(state, seq[:14], kv, 14, final=True) == 0
    assert manager.advance(state, seq[:14], kv, 14, final=True) == 0   # sent once only
    assert engine.flush(10)
    writes = [keys for op, keys, *_ in store.calls if op == "set"]
    assert writes == [page_hashes(seq[:12], PS, cache_salt="t")]
    assert store.inner.batch_exists(writes[0]) == 3
    assert engine.stats.get(OFFLOAD, PROMPT) == 3
    engine.close()


def test_stride_must_be_a_positive_int() -> None:
    cfg = config()
    engine = LocalEngine(cfg, storage=make_backend(cfg.storage, cfg.layout))
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="stride"):
            DecodeOffloadManager(engine.controller, stride=bad)
    with pytest.raises(ValueError, match="controller"):
        DecodeOffloadManager(object())  # type: ignore[arg-type]
    engine.close()


@pytest.mark.parametrize("on", [True, False], ids=["prefix_keys", "no_prefix_keys"])
def test_offload_writes_carry_prefix_keys_continuing_the_chain(on: bool) -> None:
    cfg = config(batch=2, prefix_keys=on)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    ns = ("lora-1", "tenant-a")
    r = req("r", prompt(24, 22), ns, 11)
    donor = LocalEngine(cfg, storage=store)         # an earlier request stored pages 0-1
    donor.prefill(req("d", r.input_ids[:9], ns, 1))
    assert donor.flush(10)
    donor.close()
    prefill_side, decode_side = LocalEngine(cfg), LocalEngine(cfg, storage=store)
    out = prefill_side.prefill(r)                   # no L3 here: decode offloads the prompt
    store.calls.clear()
    decode_side.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
    assert decode_side.flush(10)
    # 22 + 11 - 1 = 32 tokens have KV: 8 pages, the prompt's 5 and 3 of generated tokens
    seq = r.input_ids + r.output_ids
    names = page_hashes(seq, PS, extra_key=ns[0], cache_salt=ns[1])[:8]
    calls = [(op, names.index(keys[0]), len(keys), info, copy)
             for op, keys, info, copy in store.calls]
    # which prompt pages L3 lacks (batches of 2: it holds 0-1), then, in the request's one
    # write (its 3 generated pages never reach the default stride), prompt pages 2-4 and
    # the generated pages 5-7 in batches of 2
    assert [(op, start, n) for op, start, n, *_ in calls] == [
        ("exists", 0, 2), ("exists", 2, 2), ("set", 2, 2), ("set", 4, 2), ("set", 6, 2)]
    seed = namespace_seed(*ns)
    for op, start, _, info, copy in calls:
        assert info is not None and info.request_id == "r" and info.namespace_seed == seed
        if not on:
            assert info.prefix_keys is None and copy is None, (op, start)
            continue
        # the names before the batch, from the namespace seed on ([] for page 0): generated
        # pages continue the prompt's chain; a list handed over is never changed afterwards
        assert list(info.prefix_keys) == copy == names[:start], (op, start)
    assert store.inner.batch_exists(names) == 8
    prefill_side.close()
    decode_side.close()


def test_decode_writes_the_prompt_under_the_names_prefill_handed_over(monkeypatch) -> None:
    from pd_cache.tiering import offload

    cfg = config(batch=4)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    prefill_side, decode_side = LocalEngine(cfg), LocalEngine(cfg, storage=store)
    r = req("r", prompt(23, 22), ("lora-1", None), 9)
    out = prefill_side.prefill(r)
    priors, real = [], offload.compute_prefix_hash

    def spy(req: Req, tokens: list[int], prior: bytes | None = None, **kw: object) -> list:
        priors.append(prior)
        return real(req, tokens, prior, **kw)

    monkeypatch.setattr(offload, "compute_prefix_hash", spy)
    decode_side.decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token,
                       names=out.page_names)
    assert decode_side.flush(10)
    assert priors == [out.page_names[-1]]   # only the answer's pages named, continuing them
    written = [k for op, keys, *_ in store.calls if op == "set" for k in keys]
    assert written[:5] == list(out.page_names) and len(written) == (22 + 9 - 1) // PS
    again = req("r2", r.input_ids, ("lora-1", None), 3)
    with pytest.raises(ValueError, match="names: 4 page names for a prompt of 5 full pages"):
        decode_side.decode(again, out.kv_pages, out.num_prompt_tokens, out.first_token,
                           names=out.page_names[:-1])
    assert decode_side.locks_held() == 0
    prefill_side.close()
    decode_side.close()


def test_a_pinning_requests_writes_pin_its_prompts_pages_alone() -> None:
    """A 10-token prompt (2 full pages) pinned, decoded to 30 tokens one page at a time:
    the first write sends the prompt's pages pinned and, in a batch of its own, the page
    the answer completes unpinned; later writes pin nothing."""
    cfg = config(batch=8)
    store = Wrapper(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store)
    manager = DecodeOffloadManager(engine.controller, stride=PS)
    seq = prompt(27, 30)
    kv = engine.model(seq).kv
    r = Req(rid="r", input_ids=seq[:10], cache_salt="t", max_new_tokens=20, pin_ttl_s=60)
    state = manager.offload_kv_cache(r)
    for n in range(11, 31):
        manager.advance(state, seq[:n], kv, n, final=n == 30)
    assert engine.flush(10)
    names = page_hashes(seq, PS, cache_salt="t")[:7]
    writes = [(keys, info.pin_ttl_s) for op, keys, info, _ in store.calls if op == "set"]
    assert writes == [(names[:2], 60), (names[2:3], None)] + [([k], None) for k in names[3:]]
    assert store.inner.pins.listing("")["names"] == sorted(k.hex() for k in names[:2])
    assert store.inner.batch_exists(names) == 7
    engine.close()
