"""Buffers a decode worker takes for one request and hands back for the next.

For every request, decode makes a KV buffer for the whole sequence (the prompt's KV and
room for its answer) and, when its prefix cache kept the head of the prompt, a page tensor
joining the kept pages to the received ones: a few MiB each on the ``small`` model, alive
for one request. New memory each time is new to the kernel too: the first write of every
4 KiB page of it traps and is zeroed, and a threaded actor's calls allocate from several
malloc arenas, so what one call freed is seldom what the next one gets. In bench_pd's
decode worker that came to 45,000-49,000 page faults a run, most of them in these two
buffers (``docs/benchmarks.md``, "Decode's buffers reused"). A buffer handed back when its
request ends is lent to the next one, its pages already in memory.

Only CPU buffers are kept (a device's caching allocator keeps its own), at most
``keep_bytes`` of them while free; a buffer never handed back is freed as any tensor.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence

import torch

KEEP_BYTES = 256 << 20   # free buffers kept for reuse, at most (bytes)
MIN_BYTES = 1 << 20      # the smallest buffer made


def _made_size(need: int) -> int:
    """Elements of a new buffer for ``need``: a quarter more (a conversation's next turn is
    longer than its last), rounded up to a size class of 4-7 x a power of two (at most a
    quarter more again), so that one buffer serves requests of similar lengths."""
    n = need + need // 4
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


class Buffers:
    """Flat CPU tensors lent out as views of a shape (``take``) and taken back (``give``).

    Thread-safe: decode joins pages on its call threads and steps on its batching thread.
    """

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []      # flat buffers, smallest first
        self._free_bytes = 0
        # NOTE: the flat buffers this made, by the address of their memory, without keeping
        # them alive: a view handed back is recognised by its storage, anything else is left
        # alone.
        self._made: weakref.WeakValueDictionary[int, torch.Tensor] = \
            weakref.WeakValueDictionary()
        self.taken = self.reused = 0

    def take(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device: a free
        buffer's memory when one is large enough (the smallest that is), else new."""
        need = math.prod(shape)
        if like.device.type != "cpu" or not self.keep_bytes:
            return like.new_empty(tuple(shape))
        flat = None
        with self._lock:
            self.taken += 1
            for i, free in enumerate(self._free):
                if free.dtype == like.dtype and free.numel() >= need:
                    flat = self._free.pop(i)
                    self._free_bytes -= flat.nbytes
                    self.reused += 1
                    break
        if flat is None:
            flat = like.new_empty(max(MIN_BYTES // like.element_size(), _made_size(need)))
            with self._lock:
                self._made[flat.data_ptr()] = flat
        return flat[:need].view(tuple(shape))

    def give(self, tensor: torch.Tensor | None) -> None:
        """``tensor`` (a ``take``'s, whole) is no longer used by anyone: its memory may be
        lent again. Any other tensor is ignored."""
        if tensor is None:
            return
        with self._lock:
            base = self._made.get(tensor.untyped_storage().data_ptr())
            if base is None or tensor.untyped_storage().nbytes() != base.nbytes:
                return
            if any(free is base for free in self._free):
                raise ValueError("Buffers.give: this buffer was handed back already")
            self._free.append(base)
            self._free.sort(key=lambda t: t.nbytes)
            self._free_bytes += base.nbytes
            while self._free_bytes > self.keep_bytes:
                dropped = self._free.pop(0)
                self._free_bytes -= dropped.nbytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
