"""The reader's side of a tier's answer: fetch lent blocks, verify every record asked for.

A ``memory`` tier answers a get with refs to blocks (one object-store object per write
batch, see ``pd_cache.storage.shared``) and, per key, where its record is in them. The
reader maps every block of the answer in one ``ray.get`` (read-only views of shared memory
on one node), then verifies each record it asked for: the cheap header checks one by one,
then every checksum in one :class:`Checksummer` call, which splits a large batch over a
few threads (``pd_cache.storage.spread``). A record that fails is a miss the tier is told
to discard; a block that cannot be fetched (the tier died with its objects, or the
deadline passed) makes its keys misses. An arena record (``storage.arena``) comes as a
record already (a view of its slot, or its bytes), or as ``Lost``: a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from pd_cache.core.config import KVLayout
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.arena_record import Lost
from pd_cache.storage.base import Pending, ShardFault
from pd_cache.storage.record import PageRecord, checksums, verify_all
from pd_cache.storage.shared import SharedPages
from pd_cache.storage.spread import Spread

log = logging.getLogger(__name__)

T = TypeVar("T")

class Checksummer(Spread):
    """Computes the checksums of many payloads, on up to ``threads`` threads at once."""

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(threads, "pd-cache-hash")

    def __call__(self, tensors: list[torch.Tensor]) -> list[int]:
        return self.map(checksums, tensors, sum(t.numel() * t.element_size() for t in tensors))


class Received(NamedTuple):
    """What a reader made of one lent pool answer."""

    pages: list[PageRecord | None]  # verified records, ``None`` for every miss
    bad: list[bytes]                # keys whose record failed verification (discard them)
    lost: int                       # keys lent but not fetched (tier died, timed out)
    reason: MissReason | None       # why they were not fetched
    detail: str


def receive(shared: SharedPages, keys: Sequence[bytes], priors: Sequence[bytes | None],
            layout: KVLayout, algo: str, deadline: float | None,
            request_id: str | None = None, hash_all: Checksummer | None = None) -> Received:
    """Fetch the lent blocks of ``keys`` in one call (zero-copy on one node), or take the
    records sent by value, and verify each record asked for, here, on the bytes received
    (checksums through ``hash_all``; inline when ``None``)."""
    pages: list[PageRecord | None] = []
    problems: dict[int, str] = {}
    lost, reason, detail = 0, None, ""
    if not shared.lent:
        pages = [p if p is None or isinstance(p, PageRecord) else None for p in shared.pages]
        problems = {k: "not a record" for k, p in enumerate(shared.pages)
                    if p is not None and pages[k] is None}
    else:
        blocks, reason, detail = _fetch(shared.blocks, deadline)
    for k, at in enumerate(shared.pages if shared.lent else ()):
        if isinstance(at, Lost):   # an arena record gone since it was lent
            lost += 1
            reason, detail = reason or MissReason.STORAGE_ERROR, detail or at.detail
            pages.append(None)
            continue
        if at is None or isinstance(at, PageRecord):   # absent, or an arena record
            pages.append(at)
            continue
        block = blocks[at[0]]
        lost += block is None
        pages.append(None if block is None else _pick(block, at[1]))
        if block is not None and pages[k] is None:
            problems[k] = "not a record"
    got = [k for k, page in enumerate(pages) if page is not None]
    found = verify_all([pages[k] for k in got], [keys[k] for k in got],
                       [priors[k] for k in got], layout, algo, pool=shared.pool,
                       hash_all=hash_all or checksums)
    problems.update((k, problem) for k, problem in zip(got, found) if problem)
    for k, problem in sorted(problems.items()):
        log.warning("dropping lent L3 record %s/%s (request %s): %s", shared.pool,
                    keys[k].hex(), request_id, problem)
        pages[k] = None
    return Received(pages, [keys[k] for k in sorted(problems)], lost,
                    reason if lost else None, detail)


def _pick(block: Any, i: int) -> PageRecord | None:
    """Record ``i`` of a fetched block, if there is one."""
    if isinstance(block, tuple) and 0 <= i < len(block) and isinstance(block[i], PageRecord):
        return block[i]
    return None


def _fetch(refs: list[Any], deadline: float | None
           ) -> tuple[list[Any], MissReason | None, str]:
    """``ray.get`` of the blocks ``refs``; what could not be fetched is ``None``."""
    import ray

    if not refs:
        return [], None, ""
    try:
        return list(ray.get(refs, timeout=remaining(deadline))), None, ""
    except ray.exceptions.GetTimeoutError as e:
        return [None] * len(refs), MissReason.TIMEOUT, f"{type(e).__name__}: {e}"[:300]
    except ray.exceptions.RayError as e:
        # NOTE: usually the tier died and its objects with it (OwnerDiedError); one lost
        # object must not cost the others, so fetch what is left one by one.
        detail = f"{type(e).__name__}: {e}"[:300]
        return [_fetch_one(r, deadline) for r in refs], MissReason.STORAGE_ERROR, detail


def _fetch_one(ref: Any, deadline: float | None) -> Any:
    import ray

    try:
        return ray.get(ref, timeout=remaining(deadline))
    except ray.exceptions.RayError:
        return None


OPENER = -1   # a ``ShardFault.shard`` that is no shard: the reader, whose open refused it


class Opening(Pending[T]):
    """A get whose records are opened as it is collected: a page that does not open is a
    fault of the result (after the shards' own), so a caller counts its miss by its reason
    (not as a page the store does not hold)."""

    def __init__(self, inner: Pending[Any],
                 fn: Callable[[Any, list[ShardFault]], T]) -> None:
        self._inner, self._fn, self._refused = inner, fn, []

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout: float | None = None) -> T:
        self._refused.clear()
        return self._fn(self._inner.result(timeout), self._refused)

    @property
    def faults(self) -> list[ShardFault]:
        return [*self._inner.faults, *self._refused]


def count_read(stats: Stats, metrics: Any, event: Event, reason: MissReason,
               n: int = 1) -> None:
    """Count what a reader saw in its ``stats``; a miss also in ``metrics`` (if any:
    ``pd_cache_storage_misses_total``), where a store's own misses are exported by it."""
    stats.count(event, reason, n)
    if event is Event.MISS and metrics is not None:
        metrics.count_miss(reason, n)


def remaining(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (never negative; ``None``: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
