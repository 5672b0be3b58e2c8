"""The MLP's scratch: the same values as fresh tensors, memory reused per thread, nothing of
it left in what a forward returns."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from pd_cache.core.config import ModelConfig
from pd_cache.model.layers import SCRATCH, Scratch, gated
from pd_cache.model.model import Model

SMALL = ModelConfig.preset("small")


def _plain_mlp(block, x: torch.Tensor) -> torch.Tensor:
    """The MLP written out with a new tensor for every step (the formula, no scratch)."""
    h = block.mlp_norm(x)
    return x + F.linear(F.silu(F.linear(h, block.w_gate)) * F.linear(h, block.w_up),
                        block.w_down)


def test_mlp_through_scratch_equals_the_formula_to_the_bit_as_lengths_grow_and_shrink() -> None:
    torch.manual_seed(0)
    block = Model(SMALL).blocks[0]
    for t in (5, 300, 1, 1500, 64, 3000, 300):
        x = torch.randn(t, SMALL.hidden_size)
        assert torch.equal(block._mlp(x), _plain_mlp(block, x)), t


def test_gated_with_biases_and_leading_dims_equals_the_formula_to_the_bit() -> None:
    g = torch.Generator().manual_seed(2)
    w_gate, w_up = torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g)
    b_gate, b_up = torch.randn(48, generator=g), torch.randn(48, generator=g)
    # NOTE: 2,000 and 3 x 700 rows take the scratch (above SCRATCH_MIN_BYTES), 5 rows not.
    for shape in ((2000, 16), (3, 700, 16), (5, 16)):
        h = torch.randn(*shape, generator=g)
        want = F.silu(F.linear(h, w_gate, b_gate)) * F.linear(h, w_up, b_up)
        assert torch.equal(gated(h, w_gate, w_up, b_gate, b_up), want), shape
        assert torch.equal(gated(h, w_gate, w_up),
                           F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)), shape


def test_scratch_lends_the_same_memory_until_a_larger_pair_is_asked() -> None:
    scratch, like = Scratch(limit=1 << 20), torch.empty(0)
    a, b = scratch.pair(10, 8, like)
    assert a.shape == b.shape == (10, 8) and a.data_ptr() != b.data_ptr()
    again = scratch.pair(4, 8, like)
    assert [t.data_ptr() for t in again] == [a.data_ptr(), b.data_ptr()]
    grown = scratch.pair(100, 8, like)
    assert grown[0].data_ptr() != a.data_ptr()
    assert scratch.pair(90, 8, like)[0].data_ptr() == grown[0].data_ptr()
    # NOTE: above the limit a pair is made for the call and not kept.
    big = scratch.pair(1 << 16, 8, like)
    assert big[0].shape == (1 << 16, 8)
    assert scratch.pair(90, 8, like)[0].data_ptr() == grown[0].data_ptr()
    as_double = scratch.pair(4, 8, torch.empty(0, dtype=torch.float64))
    assert as_double[0].dtype == torch.float64


def test_all_threads_keep_at_most_the_total_and_a_finished_thread_gives_its_share_back() -> None:
    # NOTE: the count is the process's; other scratch (this module's forwards) is in it too.
    scratch, like = Scratch(limit=1 << 20, total=Scratch.held_bytes() + (3 << 20)), torch.empty(0)
    kept: list[int] = []

    def fill() -> None:
        kept.append(scratch.pair(1000, 100, like)[0].data_ptr())   # 2 x 500 KB kept
        assert scratch.pair(1000, 100, like)[0].data_ptr() == kept[-1]

    before = Scratch.held_bytes()
    for _ in range(2):
        th = threading.Thread(target=fill)
        th.start()
        th.join()
    # NOTE: each thread's pair went with it, so the second thread could keep one too.
    assert Scratch.held_bytes() == before
    a = scratch.pair(1000, 100, like)[0]
    assert Scratch.held_bytes() == before + 2 * 125_000 * 4
    blocked: list[bool] = []

    def over() -> None:
        first = scratch.pair(2000, 100, like)[0]    # 2 x 1 MB more: past the total
        blocked.append(first.data_ptr() != scratch.pair(2000, 100, like)[0].data_ptr())

    holder = Scratch(limit=1 << 22, total=scratch.total)
    holder.pair(1 << 17, 1, like)                   # 2 x 640 KiB of the total kept here
    assert Scratch.held_bytes() == before + 2 * 125_000 * 4 + 2 * 163_840 * 4
    th = threading.Thread(target=over)
    th.start()
    th.join()
    assert blocked == [True]
    assert scratch.pair(1000, 100, like)[0].data_ptr() == a.data_ptr()


def test_each_thread_has_scratch_of_its_own_and_concurrent_forwards_agree() -> None:
    model = Model(SMALL)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist()
               for n in (700, 90, 1200, 33)]
    alone = [model.forward(ids).logits for ids in prompts]
    here = SCRATCH.pair(2, 2, torch.empty(0))[0].data_ptr()
    seen, got, errors = [], {}, []

    def run(k: int) -> None:
        try:
            seen.append(SCRATCH.pair(2, 2, torch.empty(0))[0].data_ptr())
            for _ in range(3):
                for i, ids in enumerate(prompts[k:] + prompts[:k]):
                    got.setdefault((k, (i + k) % len(prompts)), []).append(
                        model.forward(ids).logits)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len({here, *seen}) == 3
    for (_, i), outs in got.items():
        assert all(torch.equal(out, alone[i]) for out in outs)


def test_what_a_forward_returns_is_not_overwritten_by_the_next_one() -> None:
    model = Model(SMALL)
    first = model.forward(list(range(1, 400)), all_logits=True)
    logits, kv = first.logits.clone(), first.kv.clone()
    model.forward(list(range(400, 900)), all_logits=True)
    assert torch.equal(first.logits, logits) and torch.equal(first.kv, kv)
