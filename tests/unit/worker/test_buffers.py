"""Decode's per-request buffers: lent, taken back and lent again (``worker.buffers``), and
what a decode draws through reused buffers equals the model's own answer."""

from __future__ import annotations

import pytest
import torch

from pd_cache.core.request import Req
from pd_cache.model.model import Model, reference_generate
from pd_cache.storage import make_backend
from pd_cache.worker.buffers import MIN_BYTES, Buffers
from pd_cache.worker.workers import DecodeWorker, PrefillWorker
from tests.unit.tiering.fakes import SMALL, prompt
from tests.unit.worker.handoff import clean, turn

LIKE = torch.zeros(1)


def test_a_buffer_handed_back_is_lent_again_for_a_shape_it_holds() -> None:
    buffers = Buffers()
    a = buffers.take((2, 3, 100), LIKE)
    assert a.shape == (2, 3, 100) and a.dtype == torch.float32 and a.is_contiguous()
    address = a.data_ptr()
    buffers.give(a)
    assert buffers.free_bytes >= MIN_BYTES
    b = buffers.take((7, 50), LIKE)
    assert b.data_ptr() == address and buffers.reused == 1 and buffers.free_bytes == 0
    c = buffers.take((7, 50), LIKE)   # none free: new memory
    assert c.data_ptr() != address and buffers.reused == 1 and buffers.taken == 3


def test_the_smallest_free_buffer_that_holds_the_shape_is_lent() -> None:
    buffers = Buffers()
    small = buffers.take((MIN_BYTES // 4,), LIKE)
    big = buffers.take((4 * MIN_BYTES // 4,), LIKE)
    small_at, big_at = small.data_ptr(), big.data_ptr()
    buffers.give(big)
    buffers.give(small)
    assert buffers.take((3 * MIN_BYTES // 4,), LIKE).data_ptr() == big_at
    assert buffers.take((10,), LIKE).data_ptr() == small_at


def test_what_it_did_not_lend_is_ignored_and_a_second_hand_back_refused() -> None:
    buffers = Buffers()
    buffers.give(None)
    buffers.give(torch.empty(1000))
    buffers.give(torch.empty(1000)[10:])   # a view of a tensor it did not make
    assert buffers.free_bytes == 0
    a = buffers.take((100,), LIKE)
    buffers.give(a)
    with pytest.raises(ValueError, match="handed back already"):
        buffers.give(a)


def test_free_buffers_are_kept_up_to_keep_bytes_and_by_dtype() -> None:
    buffers = Buffers(keep_bytes=MIN_BYTES)
    a, b = buffers.take((10,), LIKE), buffers.take((10,), LIKE)
    buffers.give(a)
    buffers.give(b)
    assert buffers.free_bytes <= MIN_BYTES
    doubles = buffers.take((10,), torch.zeros(1, dtype=torch.float64))
    assert doubles.dtype == torch.float64 and buffers.reused == 0
    none = Buffers(keep_bytes=0)
    x = none.take((10,), LIKE)
    none.give(x)
    assert none.free_bytes == 0 and none.take((10,), LIKE).data_ptr() != 0


def test_decode_through_reused_buffers_answers_as_the_model_and_refuses_an_ended_sequence(
        ) -> None:
    model = Model(SMALL.model)
    storage = make_backend(SMALL.storage, SMALL.layout)
    p, d = PrefillWorker(SMALL, storage=storage), DecodeWorker(SMALL, storage=storage)
    ids = prompt(1, 37)
    for n in range(4):   # a conversation: each turn's prompt is the last one's + answer
        req = Req(rid=f"t{n}", input_ids=ids, cache_salt="a", max_new_tokens=6)
        out, info = turn(p, d, req)
        assert out.output_ids == reference_generate(model, req).output_ids, n
        assert n == 0 or info.kept_pages > 0
        ids = ids + out.output_ids + prompt(10 + n, 5)
    buffers = d.engine.buffers
    # NOTE: every turn takes a KV buffer, every turn after the first a joined page tensor
    assert buffers.taken == 4 + 3 and buffers.reused >= 4
    engine = d.engine
    req = Req(rid="ended", input_ids=prompt(3, 20), max_new_tokens=4)
    info, pages, _ = p.prefill(req)
    seq = engine.start_decode(req, pages, 20, info.first_token)
    engine.stop_decode(seq)
    with pytest.raises(ValueError, match="ended"):
        engine.decode_step([seq])
    clean(p, d)
    for w in (p, d):
        w.close()
