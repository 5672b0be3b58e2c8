"""Recurrent states of a hybrid model: which pages keep one, and the pool that holds them.

A hybrid prefix resumes from the KV of every one of its pages *and* the recurrent state
after its last page. States are kept only at checkpoint pages: every ``state_every_pages``
pages, and at the last full page of each write (a prefill, one offload of decode)::

    page   0  1  2  3  4  5  6  7  8  9        every = 4, a write of pages 0..9
    state           x           x     x        3 and 7 (every 4th page), 9 (the write's last)

So a system prompt that many requests share has checkpoints inside it, and a whole
conversation turn ends with one. A cached prefix is usable up to its last page that has a
state; past it, tokens are recomputed from that state.

In a worker, the radix tree's nodes at checkpoints hold a slot of the ``StatePool`` (one
per node at most; it lives as long as the node, whatever tier its KV is in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pd_cache.core.config import KVLayout
from pd_cache.kv.pages import check_tensor
from pd_cache.kv.pool import SlotPool


def checkpoints(first: int, last: int, every: int) -> list[int]:
    """Pages ``first .. last`` (0-based, inclusive) that keep a state: each page ``i`` with
    ``(i + 1) % every == 0``, and ``last``. Empty when ``last < first``."""
    if last < first:
        return []
    out = [i for i in range(first, last + 1) if (i + 1) % every == 0]
    return out if out and out[-1] == last else [*out, last]


def check_states(states: Any, layout: KVLayout, *, field: str = "states",
                 num: int | None = None) -> None:
    """Float32 states ``[n, *layout.state_shape]`` (``n == num`` when given), or ValueError."""
    check_tensor(states, field, torch.float32)
    if states.ndim != 3 or tuple(states.shape[1:]) != layout.state_shape:
        raise ValueError(f"{field}: expected shape [n, {', '.join(map(str, layout.state_shape))}]"
                         f", got {list(states.shape)}")
    if num is not None and states.shape[0] != num:
        raise ValueError(f"{field}: expected {num} states, got {states.shape[0]}")


class StatePool(SlotPool):
    """Recurrent states ``[capacity, *layout.state_shape]`` float32, on the worker's device."""

    def __init__(self, capacity: int, layout: KVLayout,
                 device: torch.device | str = "cpu") -> None:
        if not layout.has_state:
            raise ValueError(f"layout: {layout.model_id} has no recurrent state to pool")
        super().__init__("state", capacity, layout, layout.state_shape, torch.float32, device)

    def write(self, slots: Sequence[int], states: torch.Tensor) -> None:
        """Store ``states`` ``[len(slots), *state_shape]`` into ``slots``."""
        check_states(states, self.layout, field="state.write: states", num=len(slots))
        if slots:
            index = torch.as_tensor(list(slots), dtype=torch.long, device=self.device)
            self.data.index_copy_(0, index, states.to(self.device))
