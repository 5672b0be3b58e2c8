"""Decode's sequence buffers kept for the next sequences: which one a sequence gets, the
budget, and a sequence decoded in another's used buffer giving the no-cache model's tokens."""

from __future__ import annotations

import random

import torch

from pd_cache.core.request import Req
from pd_cache.model.model import reference_generate
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.seq_buffers import ROUND_TOKENS, SeqBuffers
from tests.unit.worker.test_engine import VOCAB, assert_quiescent, config

SHAPE = (2, 3, 4, 8)   # two, layers, heads, dim


def take(buffers: SeqBuffers, tokens: int) -> torch.Tensor:
    two, layers, heads, dim = SHAPE
    return buffers.take(two, layers, tokens, heads, dim)


def test_a_freed_buffer_goes_to_the_smallest_sequence_it_fits_within_the_budget() -> None:
    one = torch.empty(0)                              # the pool's tensor: dtype, device
    row = 2 * 3 * 4 * 8 * one.element_size()          # bytes per token
    buffers = SeqBuffers(one, budget_bytes=3 * ROUND_TOKENS * row)
    small, big = take(buffers, 10), take(buffers, ROUND_TOKENS + 1)
    assert (small.shape[2], big.shape[2]) == (ROUND_TOKENS, 2 * ROUND_TOKENS)   # rounded up
    buffers.give(big)
    buffers.give(small)
    assert buffers.kept_bytes == 3 * ROUND_TOKENS * row
    again = take(buffers, 5)                            # both fit: the smaller one
    assert again.data_ptr() == small.data_ptr()
    assert take(buffers, 3 * ROUND_TOKENS).data_ptr() not in (small.data_ptr(), big.data_ptr())
    assert take(buffers, ROUND_TOKENS + 7).data_ptr() == big.data_ptr()
    buffers.give(take(buffers, 4 * ROUND_TOKENS))        # over the budget: not kept
    assert buffers.kept_bytes == 0
    other = SeqBuffers(one.to("meta"))                   # not the CPU: nothing kept
    other.give(take(other, 10))
    assert other.kept_bytes == 0


def test_a_sequence_decodes_in_a_longer_ones_used_buffer_to_the_no_cache_tokens() -> None:
    engine = LocalEngine(config(device=0, host=0))       # no cache: every page computed
    rng = random.Random(5)
    long_prompt = [rng.randrange(VOCAB) for _ in range(150)]
    short_prompt = [rng.randrange(VOCAB) for _ in range(30)]
    seqs = []
    for i, (prompt, new) in enumerate([(long_prompt, 20), (short_prompt, 12)]):
        r = Req(rid=f"r{i}", input_ids=prompt, max_new_tokens=new)
        out = engine.prefill(r)
        seq = engine.start_decode(r, out.kv_pages, out.num_prompt_tokens, out.first_token)
        seqs.append(seq)
        while not seq.done:
            engine.decode_step([seq])
        buf = seq.buf
        tokens = engine.finish_decode(seq)
        assert seq.buf.shape[2] == 0                     # its buffer is free again
        ref = reference_generate(engine.model, Req(rid="ref", input_ids=prompt,
                                                   max_new_tokens=new))
        assert tokens == ref.output_ids, i
        if i == 0:
            first = buf.data_ptr()
            assert engine.seq_buffers.kept_bytes == buf.nbytes
            assert torch.count_nonzero(buf[:, :, 100:160]) > 0   # the long one's KV stays
        else:
            assert buf.data_ptr() == first                # the short one decoded in it
    assert_quiescent(engine)
    engine.close()
