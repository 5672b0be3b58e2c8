"""The ``memory`` backend of a tier actor with an arena (``pd_cache.storage.arena``).

A worker on the shard's Ray node asks for slots (:meth:`ArenaBackend.arena_grant`), seals
its records into them and sets :class:`~pd_cache.storage.arena_record.ArenaRecord`\\ s: the
shard checks each as it checks any record and adopts its slot (no copy). Anything else
(records set by value: another Ray node's workers, a record too big for a slot, no free
slot) is kept as before, in object-store blocks (``storage.shared``). A get lends an
arena record to a reader on the same node as a reference to its slot, and sends it by
value to any other.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from pd_cache.core.config import KVLayout, StorageConfig
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.arena import Arena, Grant, SlotTable
from pd_cache.storage.arena_record import ArenaRecord, Lost, Where, slot_payloads
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.batch import Batch, check_batch
from pd_cache.storage.local import Refusal, Slot
from pd_cache.storage.record import TAG_BYTES, PageRecord
from pd_cache.storage.shared import SharedMemoryBackend, SharedPages

log = logging.getLogger(__name__)


def slot_bytes(layout: KVLayout) -> int:
    """The largest one-pool sealed record of ``layout``: a KV page, or a hybrid's state."""
    state = 4 * math.prod(layout.state_shape) if layout.has_state else 0
    return max(layout.page_nbytes, state) + TAG_BYTES


class ArenaBackend(SharedMemoryBackend):
    """:class:`SharedMemoryBackend` plus an arena of ``capacity_bytes // slot`` slots, its
    memory faulted in when it is made with ``prefault`` (``StorageConfig.arena_prefault``)."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, *,
                 algo: str = "xxh3_128", prefault: bool = True) -> None:
        super().__init__(layout, capacity_bytes, algo=algo)
        size = slot_bytes(layout)
        slots = capacity_bytes // size
        self.arena: Arena | None = None
        try:
            self.arena = Arena.create(size, slots) if slots else None
        except OSError as e:   # NOTE: no memfd here: every record takes the object store
            log.warning("L3 shard without an arena: %s", e)
        if self.arena is not None and prefault and not self.arena.prefault():
            log.info("L3 shard arena: pages come in on first write (no MADV_POPULATE_WRITE)")
        self.table = SlotTable(slots)
        self._grants = 0   # arena_grant calls answered
        self._held: dict[Slot, Where] = {}

    @classmethod
    def from_config(cls, config: StorageConfig, layout: KVLayout, *, algo: str = "xxh3_128",
                    shard: int = 0) -> ArenaBackend:
        """The arena backend of one shard, holding its share of ``config.capacity_bytes``."""
        return cls(layout, config.shard_capacity_bytes, algo=algo,
                   prefault=config.arena_prefault)

    # -- writes ---------------------------------------------------------------------------
    def arena_grant(self, sizes: Sequence[int], node: str, spare: int = 0) -> Grant:
        """A slot for each record of ``sizes`` bytes that fits one, while there are free
        ones (evicting arena records, tails first, to make room), and up to ``spare`` more
        of the free ones (never evicting for them: a lease for the caller's next sets). No
        arena for a caller on another Ray node (``node``: its ``arena.this_node()``)."""
        if self.arena is None or node != self.arena.info.node:
            return Grant(None, [None] * len(sizes))
        fits = [i for i, n in enumerate(sizes) if 0 < n <= self.arena.info.slot_bytes]
        with self._lock:
            self._expire()
            while self.table.free < len(fits) and \
                    (victim := self._policy.victim()) is not None and victim in self._held:
                self._evict(victim)
            now = time.monotonic()
            granted = self.table.grant(len(fits), now)
            ahead = self.table.grant(min(max(0, spare), self.table.free), now)
            for slot, _ in granted + ahead:
                self.arena.set_word(slot, 0)
            self._grants += 1
        out: list[tuple[int, int] | None] = [None] * len(sizes)
        for i, got in zip(fits, granted):
            out[i] = got
        return Grant(self.arena.info, out, ahead)

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        clean, lost = _without_lost(transfers)
        if lost:
            self._stats.count(Event.REFUSED, MissReason.STORAGE_ERROR, lost)
        acks = super().batch_set_v2(clean, extra_info)
        with self._lock:   # NOTE: a grant a page did not take (refused, already stored)
            for where in self._mine(clean):
                if self.table.granted.get(where.slot, (0,))[0] == where.gen:
                    self._free(where.slot)
        return [_restored(t, a) for t, a in zip(transfers, acks)]

    def _write_all(self, items: list[tuple[Slot, PageRecord]]) -> list[Refusal | None]:
        mine = [self._own(record) for _, record in items]
        errors: list[Refusal | None] = [None] * len(items)
        for k, ((slot, _), where) in enumerate(zip(items, mine)):
            if where is not None:
                errors[k] = self._adopt(slot, where)
        others = [k for k, where in enumerate(mine) if where is None]
        if others:
            for k, error in zip(others, super()._write_all([items[k] for k in others])):
                errors[k] = error
        return errors

    def _adopt(self, slot: Slot, where: Where) -> Refusal | None:
        assert self.arena is not None
        if self.arena.word(where.slot) != where.gen or \
                not self.table.adopt(where.slot, where.gen):
            return Refusal(MissReason.STORAGE_ERROR, f"arena slot {where.slot} is not whole "
                                                     f"or not granted")
        self._held[slot] = where
        return None

    def _own(self, record: PageRecord) -> Where | None:
        if isinstance(record, ArenaRecord) and self.arena is not None \
                and record.where.arena.id == self.arena.info.id:
            return record.where
        return None

    def _mine(self, transfers: Sequence[PoolTransfer]) -> list[Where]:
        return [w for t in transfers for p in t.pages or []
                if (w := self._own(p)) is not None]

    def _expire(self) -> None:
        for slot in self.table.expired(time.monotonic()):
            self._free(slot)

    def _free(self, slot: int) -> None:
        assert self.arena is not None
        self.arena.set_word(slot, 0)
        self.table.release(slot)

    # -- where the bytes are --------------------------------------------------------------
    def _read(self, slot: Slot) -> PageRecord | None:
        where = self._held.get(slot)
        if where is None:
            return super()._read(slot)
        assert self.arena is not None
        payloads = slot_payloads(self.arena, where.slot, self._index[slot].header)
        return None if payloads is None else PageRecord(self._index[slot].header, payloads)

    def _delete(self, slot: Slot) -> None:
        where = self._held.pop(slot, None)
        if where is None:
            super()._delete(slot)
        else:
            self._free(where.slot)

    # -- reads ----------------------------------------------------------------------------
    def batch_lend_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None,
                      node: str | None = None) -> list[SharedPages]:
        """``SharedMemoryBackend.batch_lend_v2``; an arena record is lent by reference to
        a reader on this node (``node``: its ``arena.this_node()``), else sent by value."""
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        near = self.arena is not None and node == self.arena.info.node
        with self._lock:
            return [self._lend_mixed(b, near) for b in batches]

    def _lend_mixed(self, b: Batch, near: bool) -> SharedPages:
        blocked = [i for i, k in enumerate(b.keys) if (b.pool, k) not in self._held]
        lent = self._lend(b._replace(keys=[b.keys[i] for i in blocked],
                                     priors=[b.priors[i] for i in blocked]))
        blocks = iter(lent.pages)
        pages: list[Any] = []
        for key, prior in zip(b.keys, b.priors):
            slot = (b.pool, key)
            if slot not in self._held:
                pages.append(next(blocks))
            elif not self._available(slot, prior):
                pages.append(None)
            else:
                self._served(slot)
                pages.append(self._lent_record(slot, near))
        return msgspec.structs.replace(lent, pages=pages)

    def _lent_record(self, slot: Slot, near: bool) -> PageRecord | None:
        header = self._index[slot].header
        return ArenaRecord(header, (), self._held[slot]) if near else self._read(slot)

    def arena_usage(self) -> dict[str, Any]:
        """The arena's slots by state, its id (``None``: no arena) and the ``arena_grant``
        calls it answered."""
        with self._lock:
            t = self.table
            return {"id": None if self.arena is None else self.arena.info.id,
                    "free": t.free, "granted": len(t.granted), "live": len(t.live),
                    "grant_calls": self._grants}


def _without_lost(transfers: Sequence[PoolTransfer]) -> tuple[list[PoolTransfer], int]:
    """``transfers`` without the pages that arrived as :class:`Lost` (their arena is not
    this one: the shard restarted since the grant), and how many those were."""
    out, lost = [], 0
    for t in transfers:
        keep = [i for i, p in enumerate(t.pages or []) if not isinstance(p, Lost)]
        if t.pages is None or len(keep) == len(t.pages):
            out.append(t)
            continue
        lost += len(t.pages) - len(keep)
        out.append(PoolTransfer(t.pool, [t.keys[i] for i in keep], [t.pages[i] for i in keep],
                                None if t.priors is None else [t.priors[i] for i in keep]))
    return out, lost


def _restored(t: PoolTransfer, acks: list[bool]) -> list[bool]:
    """``acks`` of ``t``'s kept pages, with ``False`` back at each lost page's place."""
    got = iter(acks)
    return [False if isinstance(p, Lost) else next(got) for p in t.pages or []]
