"""The pinned records of one L3 shard: held from eviction until their pin lapses.

A write whose ``ExtraInfo.pin_ttl_s`` is set pins the records it stored (each hit renews a
pin by its TTL, ``pd_cache.core.pins``). A shard knows a record's tenant only by its owner
label (``Seal.owner``; ``""`` for an unsealed record), so pins are listed and dropped by
that label. No more than ``max_pinned_fraction`` of the shard's capacity is pinned: a page
past it is stored unpinned. The eviction policy sets a pinned victim aside
(``EvictionPolicy.held``) and takes it back when the shard hands it ``expired()``.
Pins live in the shard's memory: a restarted shard (a ``disk`` one keeps its records)
comes back with none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pd_cache.core.fields import check_fraction
from pd_cache.core.pins import Pin, Pins
from pd_cache.storage.batch import Batch
from pd_cache.storage.entries import Entry
from pd_cache.storage.eviction import Slot


class RecordPins(Pins[Slot]):
    """``Pins`` over a shard's slots, with the bytes they hold. The store calls it under
    its ``lock``; the admin calls (``listing``, ``drop_owner``) take that lock themselves."""

    def __init__(self, capacity_bytes: int, max_pinned_fraction: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, *,
                 lock: Any = None) -> None:
        super().__init__(clock)
        self.lock = lock if lock is not None else threading.RLock()
        self.capacity_bytes, self.nbytes = capacity_bytes, 0
        self._sizes: dict[Slot, int] = {}
        self.limit(max_pinned_fraction)

    def limit(self, max_pinned_fraction: float) -> None:
        """No more than this fraction of the shard's capacity pinned (from now on)."""
        check_fraction("cache.max_pinned_fraction", max_pinned_fraction)
        self.max_bytes = int(max_pinned_fraction * self.capacity_bytes)

    def pin_stored(self, batches: Sequence[Batch], acks: list[list[bool]],
                   index: Mapping[Slot, Entry], ttl_s: float | None) -> list[list[bool]]:
        """Pin the records a write just stored (``acks``, returned), as many as fit."""
        for b, acked in zip(batches, acks):
            for key, ok in zip(b.keys, acked):
                entry = index.get((b.pool, key)) if ok and ttl_s else None
                if entry is not None:
                    self.pin_record((b.pool, key), entry, ttl_s or 0.0)
        return acks

    def pin_record(self, slot: Slot, entry: Entry, ttl_s: float) -> bool:
        """Pin one stored record unless that would pass the fraction."""
        if slot not in self and self.nbytes + entry.nbytes > self.max_bytes:
            return False
        seal = entry.header.seal
        if slot not in self:
            self._sizes[slot] = entry.nbytes
            self.nbytes += entry.nbytes
        self.pin(slot, ttl_s, "" if seal is None else seal.owner.hex())
        return True

    def drop(self, key: Slot) -> Pin | None:
        self.nbytes -= self._sizes.pop(key, 0)
        return super().drop(key)

    def expired(self) -> list[Slot]:
        gone = super().expired()
        for slot in gone:
            self.nbytes -= self._sizes.pop(slot, 0)
        return gone

    def lapse(self, release: Callable[[Slot], None]) -> None:
        """Hand each record whose pin lapsed to ``release`` (the eviction policy's)."""
        for slot in self.expired():
            release(slot)

    def listing(self, owner: str) -> dict[str, object]:
        """``owner``'s pinned records here: names (hex), bytes, seconds to the latest
        expiry."""
        with self.lock:
            now = self.clock()
            mine = [(s, p) for s, p in self.items() if p.owner == owner]
            sizes = [self._sizes.get(s, 0) for s, _ in mine]
        return {"names": sorted(s[1].hex() for s, _ in mine),
                "bytes": sum(sizes),
                "expires_in_s": max((p.until - now for _, p in mine), default=0.0)}

    def drop_owner(self, owner: str) -> list[Slot]:
        """Unpin ``owner``'s records (they stay stored, evictable again once the next
        eviction collects the lapsed pins); which ones."""
        with self.lock:
            gone = [s for s, p in self.items() if p.owner == owner]
            for slot in gone:
                self.end(slot)
        return gone
