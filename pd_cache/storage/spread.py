"""Work over many payloads, spread over a few threads when the bytes are enough to pay.

xxhash and the ``cryptography`` ciphers release the GIL on large buffers, and one core
alone cannot read (or write) memory as fast as two: a large batch goes in contiguous runs
of about equal length, one per thread; a small one runs inline (handing work to threads
costs more).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pd_cache.core.fields import check_int_at_least

T = TypeVar("T")
U = TypeVar("U")

PARALLEL_MIN_BYTES = 8 << 20
MAX_THREADS = 4


def default_threads() -> int:
    """Cores this process may run on, at most ``MAX_THREADS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


class Spread:
    """Maps a function over runs of items on up to ``threads`` threads at once."""

    def __init__(self, threads: int | None = None, name: str = "pd-cache-spread") -> None:
        threads = default_threads() if threads is None else threads
        check_int_at_least("threads", threads, 1)
        self.threads, self.name = threads, name
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[Sequence[T]], list[U]], items: Sequence[T],
            nbytes: int) -> list[U]:
        """``fn`` of ``items`` (``nbytes`` in all), in order: ``fn`` of a few runs of them
        on as many threads when large enough, else of all of them here."""
        parts = min(self.threads, len(items))
        if parts < 2 or nbytes < PARALLEL_MIN_BYTES:
            return fn(items)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
        bounds = [len(items) * k // parts for k in range(parts + 1)]
        runs = [items[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
        return [out for run in self._pool.map(fn, runs) for out in run]
