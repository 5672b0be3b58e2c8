"""Prefill and decode workers in one process (no Ray)."""

from __future__ import annotations

import re
import threading
import time

import msgspec
import pytest
import torch

from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req
from pd_cache.kv import CacheKey
from pd_cache.metrics import PDCacheMetrics
from pd_cache.model.model import Model, reference_generate
from pd_cache.storage import make_backend
from pd_cache.worker.workers import DecodeWorker, PrefillWorker
from tests.unit.tiering.fakes import PS, SMALL, Wrapper, prompt


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(SMALL.model)


def serve(p: PrefillWorker, d: DecodeWorker, req: Req) -> tuple[list[int], dict[str, int]]:
    info, pages, _ = p.prefill(req)
    return d.decode(req, info, pages).output_ids, info.cached_tokens


def test_handoff_between_workers_matches_reference_and_reuses_l3(model: Model) -> None:
    storage = make_backend(SMALL.storage, SMALL.layout)
    p0, p1 = (PrefillWorker(SMALL, worker_id=i, storage=storage) for i in range(2))
    metrics = PDCacheMetrics("prometheus")
    d = DecodeWorker(SMALL, storage=storage, metrics=metrics)
    turn1 = Req(rid="t1", input_ids=prompt(1, 19), cache_salt="a", max_new_tokens=9)
    out1, cached1 = serve(p0, d, turn1)
    assert out1 == reference_generate(model, turn1).output_ids
    assert sum(cached1.values()) == 0
    assert p0.flush(10) and d.flush(10)   # turn 1's write-through and offload have landed
    # Turn 2 on the other prefill worker: its prefix (prompt + answer) comes from L3,
    # including the pages decode offloaded for the answer.
    turn2 = Req(rid="t2", input_ids=turn1.input_ids + out1 + prompt(2, 5), cache_salt="a",
                max_new_tokens=4)
    out2, cached2 = serve(p1, d, turn2)
    assert out2 == reference_generate(model, turn2).output_ids
    assert cached2["storage"] == PS * ((19 + 9 - 1) // PS) > PS * (19 // PS)
    assert d.l3_writes()["offload"] > 0 and p0.l3_writes()["backup"] == 19 // PS
    # turn 1's answer filled (19 + 9 - 1) // PS - 19 // PS pages: exported as generated,
    # acknowledged before turn 2's decode reported them
    generated = re.search(r'pd_cache_offload_pages_total\{page_kind="generated"\} (\S+)',
                          metrics.exposition())
    assert generated and float(generated.group(1)) >= (19 + 9 - 1) // PS - 19 // PS
    for w in (p0, p1, d):
        assert w.state().locks == 0
        w.close()


def test_namespace_isolation_and_names(model: Model) -> None:
    p, d = PrefillWorker(SMALL), DecodeWorker(SMALL)
    tokens = prompt(3, 17)
    a = Req(rid="a", input_ids=tokens, extra_key="lora", max_new_tokens=3)
    b = Req(rid="b", input_ids=tokens, max_new_tokens=3)
    assert p.page_names(a) == d.page_names(a) == page_hashes(tokens, PS, extra_key="lora")
    assert set(p.page_names(a)).isdisjoint(p.page_names(b))
    serve(p, d, a)
    info_b, *_ = p.prefill(b)
    assert sum(info_b.cached_tokens.values()) == 0 and info_b.cross_namespace_pages == 0
    info_a, *_ = p.prefill(Req(rid="a2", input_ids=tokens, extra_key="lora", max_new_tokens=3))
    assert info_a.cached_tokens["device"] == PS * 4 and info_a.cross_namespace_pages == 0
    p.close(), d.close()


def test_metrics_and_read_only_pages(model: Model) -> None:
    metrics = PDCacheMetrics("prometheus")
    p, d = PrefillWorker(SMALL, metrics=metrics), DecodeWorker(SMALL, metrics=metrics)
    req = Req(rid="m", input_ids=prompt(4, 10), cache_salt="t", max_new_tokens=3)
    info, pages, _ = p.prefill(req)
    frozen = pages.clone()
    d.decode(req, info, pages, handoff_s=0.002)
    assert torch.equal(pages, frozen)  # decode worked on its own copy
    text = metrics.exposition()
    assert 'pd_cache_handoff_pages_total 3.0' in text
    assert 'pd_cache_tokens_total{role="prefill",token_kind="prompt"} 10.0' in text
    assert 'pd_cache_requests_total{namespace_kind="cache_salt",role="decode"} 1.0' in text


def test_bad_requests_raise_value_error() -> None:
    p, d = PrefillWorker(SMALL), DecodeWorker(SMALL)
    with pytest.raises(ValueError, match=r"input_ids\[1\]"):
        p.prefill(Req(rid="x", input_ids=[1, SMALL.model.vocab_size + 5]))
    req = Req(rid="ok", input_ids=prompt(5, 6), max_new_tokens=2)
    info, pages, _ = p.prefill(req)
    with pytest.raises(ValueError, match="info.rid"):
        d.decode(Req(rid="other", input_ids=req.input_ids), info, pages)
    with pytest.raises(ValueError, match="config"):
        PrefillWorker({"model": "tiny"})  # type: ignore[arg-type]
    assert p.state().locks == 0


def test_concurrent_decodes_share_batches_and_fail_alone(model: Model) -> None:
    """Decode calls from several threads step together; a bad handoff fails only its own
    caller; every good answer equals the no-cache output; the batcher stops on close."""
    p = PrefillWorker(SMALL)
    d = DecodeWorker(SMALL, max_batch=3, metrics=PDCacheMetrics("prometheus"))
    reqs = [Req(rid=f"c{i}", input_ids=prompt(40 + i, 6 + 3 * i), max_new_tokens=3 + i)
            for i in range(6)]
    handoffs = [p.prefill(r) for r in reqs]
    bad = handoffs[2].info.__class__(**{**msgspec.structs.asdict(handoffs[2].info),
                                        "num_prompt_tokens": 1})
    results: dict[str, object] = {}

    def call(i: int) -> None:
        info = bad if i == 2 else handoffs[i].info
        try:
            results[reqs[i].rid] = d.decode(reqs[i], info, handoffs[i].kv_pages).output_ids
        except ValueError as e:
            results[reqs[i].rid] = e

    # NOTE: the first request's start waits until every other call is queued, so the
    # batches that follow are not left to thread timing.
    gate, start = threading.Event(), d.engine.start_decode
    d.engine.start_decode = lambda *a: gate.wait(30) and start(*a)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    while d.batcher._queue.qsize() < len(reqs) - 1:
        time.sleep(0.001)
    gate.set()
    for t in threads:
        t.join(timeout=60)
    assert isinstance(results.pop("c2"), ValueError)
    for r in reqs:
        if r.rid != "c2":
            assert results[r.rid] == reference_generate(model, r).output_ids, r.rid
    stats = d.engine_stats()
    assert stats["decode/step"] < stats["decode/token"]   # some forwards ran several
    for w in (p, d):
        w.close()
    assert not d.batcher._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        d.batcher.submit(reqs[0], handoffs[0].kv_pages, 6, handoffs[0].info.first_token)


def sets(store: Wrapper) -> list[list[bytes]]:
    """The keys of each L3 write ``store`` saw."""
    return [keys for op, keys, *_ in store.calls if op == "set"]


def test_the_answer_comes_before_the_l3_write_and_the_metrics(model: Model) -> None:
    """``prefill_first`` answers with the prompt cached and nothing sent to L3 or counted
    yet; ``after`` writes the same pages and counts the same figures ``prefill`` does."""
    req = Req(rid="r", input_ids=prompt(3, 23), max_new_tokens=5)
    runs = {}
    for way in ("first", "whole"):
        store = Wrapper(make_backend(SMALL.storage, SMALL.layout))
        metrics = PDCacheMetrics("prometheus")
        p = PrefillWorker(SMALL, storage=store, metrics=metrics)
        prompt_tokens = "pd_cache_tokens_total", {"role": "prefill", "token_kind": "prompt"}
        if way == "first":
            (info, pages, _), after = p.prefill_first(req)
            assert p.flush(10) and sets(store) == []             # no write issued yet
            assert metrics.registry.get_sample_value(*prompt_tokens) is None
            key = CacheKey.for_request(req, page_size=PS, algo=SMALL.cache.hash_algo)
            assert p.engine.cache.match_prefix(key).num_pages == 23 // PS   # cached already
            after()
        else:
            info, pages, _ = p.prefill(req)
        assert p.flush(10)
        runs[way] = (info.first_token, pages, sets(store),
                     metrics.registry.get_sample_value(*prompt_tokens))
        assert p.state().locks == 0
    first, whole = runs["first"], runs["whole"]
    assert first[0] == whole[0] == reference_generate(model, req).output_ids[0]
    assert torch.equal(first[1], whole[1])
    assert first[2] == whole[2]
    assert [k for keys in first[2] for k in keys] == page_hashes(req.input_ids, PS)
    assert first[3] == whole[3] == 23
