"""The KV buffers of decoding sequences, kept for the next sequences once theirs end.

A sequence decodes into one private buffer ``[2, L, T, Hkv, D]`` (its prompt's KV, then a
token's at each step). On the CPU a buffer of a few MiB taken from new memory faults every
4 KiB page in as its prompt is copied there: about a thousand page faults, and some 15 ms of
the batcher's thread, per request on a 1,900-token prompt here, while every sequence of the
batch waits. A finished sequence's buffer is already in memory; the next sequence that fits
takes it instead (the smallest that fits; a new one is rounded up to ``ROUND_TOKENS`` so
later ones fit). At most ``budget_bytes`` of them are kept; a GPU's caching allocator does
this already, so only CPU buffers are.

A kept buffer holds the KV of the request that used it. The next one overwrites its prompt's
tokens before any step and each step's token before attending, and nothing reads a buffer
past a sequence's position, so none of it is ever read again.
"""

from __future__ import annotations

import threading

import torch

ROUND_TOKENS = 256
BUDGET_BYTES = 64 << 20


class SeqBuffers:
    """Sequence buffers shaped like ``[2, L, T, Hkv, D]`` of ``like``'s dtype and device."""

    def __init__(self, like: torch.Tensor, budget_bytes: int = BUDGET_BYTES) -> None:
        self.like, self.budget_bytes = like, budget_bytes if like.device.type == "cpu" else 0
        self._spare: list[torch.Tensor] = []
        self._lock = threading.Lock()   # NOTE: a batcher's thread, or callers of decode()

    def take(self, two: int, layers: int, tokens: int, heads: int,
             dim: int) -> torch.Tensor:
        """A buffer of at least ``tokens`` tokens: the smallest kept one that fits, else a
        new one."""
        shape = (two, layers, heads, dim)
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.shape[2] >= tokens
                    and (*b.shape[:2], *b.shape[3:]) == shape]
            if fits:
                return self._spare.pop(min(fits, key=lambda i: self._spare[i].shape[2]))
        length = -(-tokens // ROUND_TOKENS) * ROUND_TOKENS
        return self.like.new_empty((two, layers, length, heads, dim))

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` is free again (its sequence ended); kept while the budget allows."""
        with self._lock:
            if self.kept_bytes + buf.nbytes <= self.budget_bytes:
                self._spare.append(buf)

    @property
    def kept_bytes(self) -> int:
        return sum(b.nbytes for b in self._spare)
