"""The decode batcher streams each token as it is drawn and drops a cancelled request
(which still offloads what it computed)."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req, SamplingParams
from pd_cache.core.vocab import GENERATED, OFFLOAD, PROMPT
from pd_cache.model.model import reference_generate
from pd_cache.storage import make_backend
from pd_cache.worker.batching import DecodeBatcher
from pd_cache.worker.engine import LocalEngine
from tests.unit.tiering.fakes import PS, SMALL, config, prompt


def test_tokens_stream_in_order_and_a_cancelled_request_leaves_the_batch() -> None:
    engine = LocalEngine(SMALL)
    batcher = DecodeBatcher(engine, max_batch=4)
    keep = Req(rid="keep", input_ids=prompt(1, 13), max_new_tokens=12)
    drop = Req(rid="drop", input_ids=prompt(2, 11), max_new_tokens=500)
    seen: dict[str, list[int]] = {"keep": [], "drop": []}
    started = threading.Event()

    def watch(rid: str):
        def on_token(token: int) -> None:
            seen[rid].append(token)
            if rid == "drop" and len(seen[rid]) == 3:
                started.set()
        return on_token

    futures = {}
    for r in (keep, drop):
        out = engine.prefill(r)
        futures[r.rid] = batcher.submit(r, out.kv_pages, out.num_prompt_tokens,
                                        out.first_token, watch(r.rid))
    assert started.wait(30)
    assert "drop" in batcher.in_flight()              # what a decode worker's state shows
    batcher.cancel("drop")
    with pytest.raises(CancelledError):
        futures["drop"].result(30)
    tokens = futures["keep"].result(30)
    assert tokens == reference_generate(engine.model, Req(rid="ref", input_ids=keep.input_ids,
                                                          max_new_tokens=12)).output_ids
    assert seen["keep"] == tokens[1:]                 # streamed: every token after the first
    assert len(seen["drop"]) < 100                    # it stopped costing steps
    assert engine.stats.get("deadline", "cancelled") == 1
    batcher.cancel("keep")                            # finished: ignored, nothing kept
    assert not batcher._cancelled and batcher.in_flight() == ()
    again = engine.prefill(Req(rid="keep", input_ids=keep.input_ids, max_new_tokens=12))
    assert batcher.submit(keep, again.kv_pages, again.num_prompt_tokens,
                          again.first_token).result(30) == tokens   # the rid is not cursed
    batcher.close()
    engine.close()


def test_a_request_cancelled_mid_decode_still_offloads_what_it_computed() -> None:
    """Dropped before its end, a request's prompt pages (which L3 lacked: prefill had no
    L3 here) and the generated pages filled so far reach L3 under the names a prefill of
    prompt + tokens computes."""
    cfg = config(batch=8)
    store = make_backend(cfg.storage, cfg.layout)
    prefill_side, decode_side = LocalEngine(cfg), LocalEngine(cfg, storage=store)
    batcher = DecodeBatcher(decode_side, max_batch=2)
    r = Req(rid="r", input_ids=prompt(3, 13), cache_salt="t", max_new_tokens=500)
    drawn: list[int] = []
    enough = threading.Event()

    def on_token(token: int) -> None:
        drawn.append(token)
        if len(drawn) == 9:
            enough.set()

    out = prefill_side.prefill(r)
    future = batcher.submit(r, out.kv_pages, out.num_prompt_tokens, out.first_token, on_token)
    assert enough.wait(30)
    batcher.cancel("r")
    with pytest.raises(CancelledError):
        future.result(30)
    batcher.close()
    assert decode_side.flush(10)
    seq = r.input_ids + [out.first_token] + drawn     # every token drawn, in order
    names = page_hashes(seq, PS, cache_salt="t")
    held = store.batch_exists(names)
    # the prompt's 3 full pages, then generated ones: all those with KV when it stopped
    # (at least the 9 tokens seen), none past the tokens drawn
    assert 3 + 9 // PS <= held <= (len(seq) - 1) // PS
    assert decode_side.stats.get(OFFLOAD, PROMPT) == 3
    assert decode_side.stats.get(OFFLOAD, GENERATED) == held - 3
    prefill_side.close()
    decode_side.close()


def test_a_request_that_draws_a_stop_token_leaves_the_batch_and_the_others_go_on() -> None:
    engine = LocalEngine(SMALL)
    batcher = DecodeBatcher(engine, max_batch=4)
    prompts = [prompt(11, 9), prompt(12, 14)]
    free = [reference_generate(engine.model, Req(rid="ref", input_ids=p,
                                                 max_new_tokens=10)).output_ids
            for p in prompts]
    stop = free[0][4]
    assert stop not in free[0][:4]
    sampling = SamplingParams(stop_token_ids=(stop,))
    reqs = [Req(rid=f"s{i}", input_ids=p, max_new_tokens=10, sampling=sampling)
            for i, p in enumerate(prompts)]
    futures = []
    for r in reqs:
        out = engine.prefill(r)
        futures.append(batcher.submit(r, out.kv_pages, out.num_prompt_tokens,
                                      out.first_token))
    got = [f.result(30) for f in futures]
    assert got[0] == free[0][:5]                   # stopped right after the stop token
    want = reference_generate(engine.model, Req(rid="ref", input_ids=prompts[1],
                                                max_new_tokens=10, sampling=sampling))
    assert got[1] == want.output_ids              # the other ran on as without a cache
    assert engine.locks_held() == 0
    batcher.close()
    engine.close()
