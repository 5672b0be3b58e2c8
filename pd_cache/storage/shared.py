"""Records lent through Ray's object store: a tier actor's ``memory`` backend and its readers.

Inside a tier actor the memory backend keeps the records of one write batch as one object
in the node's object store (a *block*), put once when they are stored and owned by the
actor; the index stays per page. A get answers with the blocks' refs and, per key, where
its record sits in them, and a reader on the same node maps the blocks::

    writer --batch_set--> tier: verify each record, ray.put the batch's records once
    reader --batch_get--> tier: chain check, lend block refs + (block, position) per key
    reader: one ray.get of the blocks -> read-only views; verify every record it asked
            for; a bad one is a miss and the tier is told to discard it

The reader, not the tier, checks names, checksums, shapes and dtypes, so the bytes it uses
are the bytes it verified, whatever another reader did to its own view of the object (the
request's prefetch then checks each name against its own tokens: records keep none).
Objects die with the actor that put them (``OwnerDiedError`` at a reader), as memory
records do anyway: a reader counts that as a miss (``storage_error``), never raises.

Eviction stays per page (chain tails first) and ``usage`` counts the pages kept. A block
lives while one of its pages is kept, so the pages it lost still hold memory ("dead"
bytes): past ``capacity_bytes / 4`` of them, the blocks with the most are rewritten with
their survivors (one copy), and a block that lost a page a reader found bad is rewritten
at once. The object store thus holds at most 1.25x ``capacity_bytes`` for the shard, plus
what readers still map.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from pd_cache.core.config import KVLayout
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.batch import Batch, check_batch, normalize_keys
from pd_cache.storage.local import LocalBackend, Refusal, Slot
from pd_cache.storage.record import PageRecord, check_pool_name

log = logging.getLogger(__name__)

DEAD_FRACTION = 4   # dead bytes allowed: capacity_bytes // DEAD_FRACTION


class SharedPages(msgspec.Struct, frozen=True, gc=False):
    """A tier's answer for one pool of a get, in key order: a page or ``None`` per key.

    ``lent``: ``blocks`` are object refs to tuples of records and each page is
    ``(block, position)`` there, for the reader to fetch and verify against ``layout``
    (the tier's, unless the reader knows its own). Otherwise pages are records the tier
    verified itself before sending them.
    """

    pool: str
    pages: list[Any]
    lent: bool = False
    layout: KVLayout | None = None
    blocks: list[Any] = []


class _Block:
    """The records of one write batch in one object; the backend's ref keeps it alive."""

    __slots__ = ("dead", "live", "ref", "sizes", "slots")

    def __init__(self, ref: Any, slots: list[Slot | None], sizes: list[int]) -> None:
        self.ref, self.slots, self.sizes = ref, slots, sizes
        self.live, self.dead = sum(sizes), 0


class SharedMemoryBackend(LocalBackend):
    """The ``memory`` backend of a tier actor: one object-store object per write batch.

    Bounded like ``memory`` (chain tails first); once no kept page is in a block, the
    actor drops its ref and Ray frees the object when no reader still holds a view of it.
    ``batch_get_v2`` still works (it maps the object in this process and verifies it here);
    :meth:`batch_lend_v2` is the fast path.
    """

    def __init__(self, layout: KVLayout, capacity_bytes: int, *,
                 algo: str = "xxh3_128") -> None:
        super().__init__(layout, capacity_bytes, algo=algo)
        self._where: dict[Slot, tuple[_Block, int]] = {}
        self._holed: set[_Block] = set()   # blocks holding dead bytes
        self._dead = 0
        self.dead_bytes_bound = capacity_bytes // DEAD_FRACTION

    @property
    def dead_bytes(self) -> int:
        """Bytes of pages gone from the store that their blocks still hold."""
        return self._dead

    def _write_all(self, items: list[tuple[Slot, PageRecord]]) -> list[Refusal | None]:
        import ray

        try:
            # NOTE: the one copy a batch costs: the caller's bytes into an object this
            # process owns (payloads travel as uint8 buffers, see PageRecord.__reduce__).
            ref = ray.put(tuple(record for _, record in items))
        except ray.exceptions.ObjectStoreFullError as e:
            full = Refusal(MissReason.STORAGE_ERROR, f"object store full: {e}"[:300])
            return [full] * len(items)
        block = _Block(ref, [slot for slot, _ in items], [r.nbytes for _, r in items])
        for i, (slot, _) in enumerate(items):
            self._where[slot] = (block, i)
        return [None] * len(items)

    def _write(self, slot: Slot, record: PageRecord) -> None:
        error = self._write_all([(slot, record)])[0]
        if error is not None:
            raise OSError(error.detail)

    def _read(self, slot: Slot) -> PageRecord | None:
        import ray

        where = self._where.get(slot)
        try:
            return None if where is None else ray.get(where[0].ref, timeout=30)[where[1]]
        except ray.exceptions.RayError:
            return None

    def _delete(self, slot: Slot) -> None:
        where = self._where.pop(slot, None)
        if where is None:
            return
        block, i = where
        block.slots[i] = None
        block.live -= block.sizes[i]
        if block.live:
            block.dead += block.sizes[i]
            self._dead += block.sizes[i]
            self._holed.add(block)
        else:  # its last page: the block goes (Ray frees it once readers let go)
            self._dead -= block.dead
            self._holed.discard(block)

    def _footprint(self, record: PageRecord) -> int:
        return record.nbytes

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        acks = super().batch_set_v2(transfers, extra_info)
        with self._lock:
            while self._dead > self.dead_bytes_bound and self._holed:
                self._rewrite(max(self._holed, key=lambda b: b.dead))
        return acks

    def _rewrite(self, block: _Block) -> None:
        """Put ``block``'s kept records in a new block, freeing its dead bytes."""
        import ray

        self._holed.discard(block)
        kept = [(slot, i) for i, slot in enumerate(block.slots) if slot is not None]
        try:
            records = ray.get(block.ref, timeout=30)
            refused = self._write_all([(slot, records[i]) for slot, i in kept])[0]
            error = None if refused is None else refused.detail
        except ray.exceptions.RayError as e:
            error = f"{type(e).__name__}: {e}"[:300]
        if error is not None:  # it stays as it is (its dead bytes stay counted)
            log.warning("L3 block of %d pages not rewritten: %s", len(kept), error)
            return
        self._dead -= block.dead

    def batch_lend_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> list[SharedPages]:
        """Refs to the blocks holding the stored records, after the cheap checks (index and
        chain), and where each key's record is in them.

        Counts a miss per absent key and a hit per lent key; the reader verifies the
        records and reports bad ones through :meth:`discard_v2`.
        """
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        with self._lock:
            return [self._lend(b) for b in batches]

    def _lend(self, b: Batch) -> SharedPages:
        blocks: dict[_Block, int] = {}
        pages: list[tuple[int, int] | None] = []
        for key, prior in zip(b.keys, b.priors):
            slot = (b.pool, key)
            if not self._available(slot, prior):
                pages.append(None)
                continue
            self._served(slot)
            block, i = self._where[slot]
            pages.append((blocks.setdefault(block, len(blocks)), i))
        return SharedPages(b.pool, pages, lent=True, layout=self.layout,
                           blocks=[block.ref for block in blocks])

    def discard_v2(self, pool: str, keys: Sequence[bytes | str]) -> int:
        """Delete records a reader found bad (counted ``verification_failed``); how many.

        Their blocks are rewritten without them at once: a bad page is not kept around.
        """
        slots = [(check_pool_name(pool), k) for k in normalize_keys(keys, self.algo)]
        removed = 0
        with self._lock:
            touched = {self._where[s][0] for s in slots if s in self._where}
            for slot in slots:
                if slot in self._index:
                    self._remove(slot)
                    self._stats.count(Event.VERIFICATION_FAILED)
                    removed += 1
            for block in touched & self._holed:
                self._rewrite(block)
        return removed
