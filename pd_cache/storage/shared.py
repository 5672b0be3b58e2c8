"""Records lent through Ray's object store: a tier actor's ``memory`` backend and its readers.

Inside a tier actor the memory backend keeps each record as one object in the node's
object store, put once when it is stored and owned by the actor. A get answers with object
refs instead of bytes, and a reader on the same node maps the objects::

    writer --batch_set--> tier: verify the record, ray.put it once, keep the ref
    reader --batch_get--> tier: chain check, lend the refs        (no payload bytes move)
    reader: ray.get(refs) -> read-only views; verify every record; a bad one is a miss
            and the tier is told to discard it

The reader, not the tier, checks names, checksums, shapes and dtypes, so the bytes it uses
are the bytes it verified, whatever another reader did to its own view of the object (the
request's prefetch then checks each name against its own tokens: records keep none).
Objects die with the actor that put them (``OwnerDiedError`` at a reader), as memory
records do anyway: a reader counts that as a miss (``storage_error``), never raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from pd_cache.core.config import KVLayout
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.batch import check_batch, normalize_keys
from pd_cache.storage.local import LocalBackend, Slot
from pd_cache.storage.record import PageRecord, check_pool_name, verify

log = logging.getLogger(__name__)


class SharedPages(msgspec.Struct, frozen=True, gc=False):
    """A tier's answer for one pool of a get, in key order: a page or ``None`` per key.

    ``lent``: pages are object refs to records the reader fetches and verifies against
    ``layout`` (the tier's, unless the reader knows its own). Otherwise pages are records
    the tier verified itself before sending them.
    """

    pool: str
    pages: list[Any]
    lent: bool = False
    layout: KVLayout | None = None


class SharedMemoryBackend(LocalBackend):
    """The ``memory`` backend of a tier actor: one object-store object per record.

    Bounded like ``memory`` (chain tails first); an evicted or discarded record drops the
    actor's ref, and Ray frees the object once no reader still holds a view of it.
    ``batch_get_v2`` still works (it maps the object in this process and verifies it here);
    :meth:`batch_lend_v2` is the fast path.
    """

    def __init__(self, layout: KVLayout, capacity_bytes: int, *,
                 algo: str = "xxh3_128") -> None:
        super().__init__(layout, capacity_bytes, algo=algo)
        self._refs: dict[Slot, Any] = {}

    def _write(self, slot: Slot, record: PageRecord) -> None:
        import ray

        try:
            # NOTE: the one copy a record costs: the caller's bytes into an object this
            # process owns (payloads travel as uint8 buffers, see PageRecord.__reduce__).
            self._refs[slot] = ray.put(record)
        except ray.exceptions.ObjectStoreFullError as e:
            raise OSError(f"object store full: {e}") from None

    def _read(self, slot: Slot) -> PageRecord | None:
        import ray

        ref = self._refs.get(slot)
        try:
            return None if ref is None else ray.get(ref, timeout=30)
        except ray.exceptions.RayError:
            return None

    def _delete(self, slot: Slot) -> None:
        self._refs.pop(slot, None)

    def _footprint(self, record: PageRecord) -> int:
        return record.nbytes

    def batch_lend_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> list[SharedPages]:
        """Refs to the stored records, after the cheap checks (index and chain).

        Counts a miss per absent key and a hit per lent key; the reader verifies the
        records and reports bad ones through :meth:`discard_v2`.
        """
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        with self._lock:
            return [SharedPages(b.pool, [self._lend((b.pool, k), p)
                                         for k, p in zip(b.keys, b.priors)],
                                lent=True, layout=self.layout) for b in batches]

    def _lend(self, slot: Slot, prior: bytes | None) -> Any:
        if not self._available(slot, prior):
            return None
        self._served(slot)
        return self._refs[slot]

    def discard_v2(self, pool: str, keys: Sequence[bytes | str]) -> int:
        """Delete records a reader found bad (counted ``verification_failed``); how many."""
        slots = [(check_pool_name(pool), k) for k in normalize_keys(keys, self.algo)]
        removed = 0
        with self._lock:
            for slot in slots:
                if slot in self._index:
                    self._remove(slot)
                    self._stats.count(Event.VERIFICATION_FAILED)
                    removed += 1
        return removed


class Received(NamedTuple):
    """What a reader made of one lent pool answer."""

    pages: list[PageRecord | None]  # verified records, ``None`` for every miss
    bad: list[bytes]                # keys whose record failed verification (discard them)
    lost: int                       # keys lent but not fetched (tier died, timed out)
    reason: MissReason | None       # why they were not fetched
    detail: str


def receive(shared: SharedPages, keys: Sequence[bytes], priors: Sequence[bytes | None],
            layout: KVLayout, algo: str, deadline: float | None,
            request_id: str | None = None) -> Received:
    """Fetch the lent records of ``keys`` (zero-copy on one node) and verify each one."""
    fetched, reason, detail = _fetch(shared.pages, deadline)
    pages: list[PageRecord | None] = []
    bad, lost = [], 0
    for key, prior, ref, record in zip(keys, priors, shared.pages, fetched):
        if record is None:
            lost += ref is not None
            pages.append(None)
            continue
        problem = verify(record, layout, algo, name=key, prior=prior, pool=shared.pool)
        if problem:
            log.warning("dropping lent L3 record %s/%s (request %s): %s", shared.pool,
                        key.hex(), request_id, problem)
            bad.append(key)
            record = None
        pages.append(record)
    return Received(pages, bad, lost, reason if lost else None, detail)


def _fetch(refs: list[Any], deadline: float | None
           ) -> tuple[list[PageRecord | None], MissReason | None, str]:
    """``ray.get`` of the non-``None`` refs; what could not be fetched is ``None``."""
    import ray

    present = [r for r in refs if r is not None]
    if not present:
        return [None] * len(refs), None, ""
    try:
        got = iter(ray.get(present, timeout=_remaining(deadline)))
        return [None if r is None else next(got) for r in refs], None, ""
    except ray.exceptions.GetTimeoutError as e:
        return [None] * len(refs), MissReason.TIMEOUT, f"{type(e).__name__}: {e}"[:300]
    except ray.exceptions.RayError as e:
        # NOTE: usually the tier died and its objects with it (OwnerDiedError); one lost
        # object must not cost the others, so fetch what is left one by one.
        detail = f"{type(e).__name__}: {e}"[:300]
        return [None if r is None else _fetch_one(r, deadline) for r in refs], \
            MissReason.STORAGE_ERROR, detail


def _fetch_one(ref: Any, deadline: float | None) -> PageRecord | None:
    import ray

    try:
        return ray.get(ref, timeout=_remaining(deadline))
    except ray.exceptions.RayError:
        return None


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
