"""The logic every in-process backend shares: index, bound, verification, counting, pins.

A subclass only says where a record's bytes live (:meth:`LocalBackend._write`,
``_read``, ``_delete``, ``_footprint``; ``_write_all`` to keep a batch together). The
index maps ``(pool, name)`` to the record's header and size, so ``exists`` and the chain
check never touch the bytes; the eviction policy (``pd_cache.storage.eviction``) keeps the
order in which records go: the least recently used chain first, from its tail, within
each owner's quota.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Self

from pd_cache.core.config import KVLayout, StorageConfig
from pd_cache.core.events import REMOVED, STORAGE_TIER, STORED, EventLog
from pd_cache.core.hashing import DIGEST_SIZES
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.base import ExtraInfo, PoolHits, PoolTransfer, StorageBackend, Usage
from pd_cache.storage.batch import Batch, check_batch, normalize_keys, usable_hits
from pd_cache.storage.entries import Entry, Link, Refusal, key_of, link_of, owner_of, refusal_of
from pd_cache.storage.eviction import Shares, Slot
from pd_cache.storage.owners import OwnerShares
from pd_cache.storage.pinned import RecordPins
from pd_cache.storage.record import (
    CHECKPOINT_POOLS,
    KV_POOL,
    PageRecord,
    RecordHeader,
    check_pool_name,
    verify,
)

log = logging.getLogger(__name__)

# NOTE: recently evicted names let a miss say "evicted", not "not stored" (and a new page
# whose parent just went, that it cannot serve a hit); bounded, not growing with the keys.
GHOSTS = 65536
# NOTE: a shard holds about one page in num_shards of a chain: the nearest earlier page it
# holds is a few names back. Past this many, a new page starts a chain of its own.
LINK_SCAN = 64


class LocalBackend(OwnerShares, StorageBackend):
    """A bounded, verified store of page records for one layout and hash algo.

    Full, it evicts chain tails first, within each owner's quota
    (:class:`~pd_cache.storage.eviction.Shares`).
    """

    journal: EventLog | None = None   # KV events of the kv pages stored and removed

    def __init__(self, layout: KVLayout, capacity_bytes: int, *,
                 algo: str = "xxh3_128") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes: expected an int >= 1, got {capacity_bytes!r}")
        if algo not in DIGEST_SIZES:
            raise ValueError(f"algo: unknown hash algorithm {algo!r}")
        self.layout, self.algo, self.capacity_bytes = layout, algo, capacity_bytes
        self._index: dict[Slot, Entry] = {}
        self._lock = threading.RLock()
        self.pins = RecordPins(capacity_bytes, lock=self._lock)   # fraction: tier_backend
        self._policy = Shares(self.pins.held)
        self._ghosts: OrderedDict[Slot, MissReason] = OrderedDict()   # why each one went
        self._warned: set[MissReason] = set()
        self._used = 0
        self._stats = Stats()

    @classmethod
    def from_config(cls, config: StorageConfig, layout: KVLayout, *, algo: str = "xxh3_128",
                    shard: int = 0) -> Self:
        """The backend of one shard, holding its share of ``config.capacity_bytes``."""
        return cls(layout, config.shard_capacity_bytes, algo=algo)

    # -- where the bytes live -----------------------------------------------------------
    @abstractmethod
    def _write(self, slot: Slot, record: PageRecord) -> None:
        """Keep a private copy of ``record`` (raise ``OSError`` if it cannot)."""

    @abstractmethod
    def _read(self, slot: Slot) -> PageRecord | None:
        """The stored record, or ``None`` if its bytes are unreadable."""

    @abstractmethod
    def _delete(self, slot: Slot) -> None: ...

    @abstractmethod
    def _footprint(self, record: PageRecord) -> int:
        """Bytes ``record`` occupies once stored (what the capacity bounds)."""

    def _touched(self, slot: Slot) -> None:
        """A hit just made ``slot`` most recent (the disk backend persists that)."""

    # -- the interface --------------------------------------------------------------------
    def batch_exists_v2(self, transfers: Sequence[PoolTransfer],
                        extra_info: ExtraInfo | None = None) -> PoolHits:
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        if not batches:
            raise ValueError("transfers: name at least one pool")
        with self._lock:
            per_pool = {b.pool: self._prefix(b.pool, b.keys, b.priors) for b in batches}
            checkpoints = {b.pool: [self._holds((b.pool, k), p) for k, p in zip(b.keys, b.priors)]
                           for b in batches if b.pool in CHECKPOINT_POOLS}
        return usable_hits(batches, per_pool, checkpoints)

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        rid = extra_info.request_id if extra_info else None
        with self._lock:
            return [PoolTransfer(b.pool, b.keys, [self._fetch((b.pool, k), p, rid)
                                                  for k, p in zip(b.keys, b.priors)])
                    for b in batches]

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        batches = check_batch(transfers, extra_info, self.algo, with_pages=True)
        for b in batches:
            self._check_fits(b.pages or [])
        prefix = _prefix_tail(extra_info, self.algo)
        with self._lock:
            return self.pins.pin_stored(batches, [self._put_all(b, prefix + b.keys, len(
                prefix)) for b in batches], self._index, extra_info and extra_info.pin_ttl_s)

    def clear(self) -> int:
        """Delete every record (an operator's reset, not eviction: nothing is counted as
        evicted and no ghost is kept); returns how many there were."""
        with self._lock:
            slots = list(self._index)
            for slot in slots:
                self._remove(slot)
            self._ghosts.clear()
            return len(slots)

    def discard_v2(self, pool: str, keys: Sequence[bytes | str]) -> int:
        slots = [(check_pool_name(pool), k) for k in normalize_keys(keys, self.algo)]
        with self._lock:
            gone = [slot for slot in slots if slot in self._index]
            for slot in gone:
                self._remove(slot)
                self._stats.count(Event.VERIFICATION_FAILED)
        return len(gone)

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    def usage(self) -> Usage:
        with self._lock:
            return Usage(len(self._index), self._used, self.capacity_bytes)
    def held(self) -> dict[str, list[bytes]]:   # every kv page's name (a KV events snapshot)
        with self._lock:
            return {STORAGE_TIER: [name for pool, name in self._index if pool == KV_POOL]}
    def links(self) -> list[tuple[bytes, bytes]]:   # (name, prior) of every kv page
        with self._lock:
            return [(n, e.header.prior) for (p, n), e in self._index.items() if p == KV_POOL]

    # -- lookups --------------------------------------------------------------------------
    def _prefix(self, pool: str, keys: list[bytes], priors: list[bytes | None]) -> int:
        for i, (key, prior) in enumerate(zip(keys, priors)):
            reason = self._absent((pool, key), prior)
            if reason is not None:
                self._stats.count(Event.MISS, reason)
                return i
        return len(keys)

    def _absent(self, slot: Slot, prior: bytes | None) -> MissReason | None:
        """Why ``slot`` cannot serve a page following ``prior`` (``None``: it can)."""
        entry = self._index.get(slot)
        if entry is None:
            return self._ghosts.get(slot, MissReason.NOT_STORED)
        if prior is not None and entry.header.prior != prior:
            # NOTE: the record is fine (its writer hashed its name from this prior); the
            # caller's chain does not lead to it, e.g. the keys of another namespace.
            self._stats.count(Event.REFUSED, MissReason.NAMESPACE_REFUSED)
            return MissReason.NAMESPACE_REFUSED
        return None

    def _holds(self, slot: Slot, prior: bytes | None) -> bool:
        """Whether ``slot`` is stored and follows ``prior``; counts nothing (a checkpoint
        pool is probed at every key, its misses are not the end of a prefix)."""
        entry = self._index.get(slot)
        return entry is not None and (prior is None or entry.header.prior == prior)

    def _available(self, slot: Slot, prior: bytes | None) -> bool:
        """Whether ``slot`` can serve a page following ``prior``; a miss is counted here."""
        reason = self._absent(slot, prior)
        if reason is not None:
            self._stats.count(Event.MISS, reason)
        return reason is None

    def _served(self, slot: Slot) -> None:
        self._policy.touch(slot)
        self.pins.touch(slot)
        self._touched(slot)
        self._stats.count(Event.HIT)

    def _fetch(self, slot: Slot, prior: bytes | None, rid: str | None) -> PageRecord | None:
        if not self._available(slot, prior):
            return None
        record = self._read(slot)
        problem = "unreadable" if record is None else verify(
            record, self.layout, self.algo, name=slot[1], prior=prior, pool=slot[0])
        if problem:
            log.warning("dropping L3 record %s/%s (request %s): %s", slot[0], slot[1].hex(),
                        rid, problem)
            self._remove(slot)
            self._stats.count(Event.VERIFICATION_FAILED)
            self._stats.count(Event.MISS, MissReason.VERIFICATION_FAILED)
            return None
        self._served(slot)
        return record

    # -- writes ---------------------------------------------------------------------------
    def _check_fits(self, records: list[PageRecord]) -> None:
        for i, rec in enumerate(records):
            size = self._footprint(rec)
            if size > self.capacity_bytes:
                raise ValueError(f"pages[{i}]: a record of {size} bytes exceeds "
                                 f"capacity_bytes={self.capacity_bytes}")

    def _put_all(self, b: Batch, names: list[bytes], at: int) -> list[bool]:
        """Store ``b``'s pages (``names[at:]``; ``names[:at]``: the chain before): indexed
        (evicting as they come) first, written together after (:meth:`_write_all`)."""
        new: list[tuple[int, Slot, PageRecord]] = []
        acks = [self._put((b.pool, key), rec, prior, names, at, i, new)
                for i, (key, rec, prior) in enumerate(zip(b.keys, b.pages or [], b.priors))]
        # NOTE: a page evicted by a later page of its own batch is not written; it still
        # counts as stored, then evicted (as when the bound makes a page go at once).
        todo = {slot: (i, rec) for i, slot, rec in new if slot in self._index}
        errors = self._write_all([(slot, rec) for slot, (_, rec) in todo.items()]) if todo \
            else []
        for (slot, (i, _)), error in zip(todo.items(), errors):
            if error is not None:
                self._refuse(slot, error)
                acks[i] = False
        stored = len(new) - sum(e is not None for e in errors)
        if stored:
            self._stats.count(Event.STORED, n=stored)
        return acks

    def _refuse(self, slot: Slot, error: Refusal) -> None:
        """An indexed record that could not be written goes; a later miss says why."""
        # NOTE: counted each time; logged at warning once per reason (a full disk refuses
        # every page until room is made: the count says how many).
        level = logging.DEBUG if error.reason in self._warned else logging.WARNING
        self._warned.add(error.reason)
        log.log(level, "cannot store L3 record %s/%s (%s): %s", slot[0], slot[1].hex(),
                error.reason.value, error.detail)
        self._remove(slot)
        self._stats.count(Event.REFUSED, error.reason)
        if error.reason is MissReason.DISK_FULL:
            self._ghost(slot, MissReason.DISK_FULL)

    def _write_all(self, items: list[tuple[Slot, PageRecord]]) -> list[Refusal | None]:
        """Write the records a batch just indexed; per record, why it could not be written
        (``None``: it was). One record at a time unless a backend does better."""
        errors: list[Refusal | None] = []
        for slot, record in items:
            try:
                self._write(slot, record)
                errors.append(None)
            except OSError as e:
                errors.append(refusal_of(e))
        return errors

    def _put(self, slot: Slot, record: PageRecord, prior: bytes | None, names: list[bytes],
             at: int, i: int, new: list[tuple[int, Slot, PageRecord]]) -> bool:
        """Check and index page ``i`` of a batch (``names[at + i]``); one new to the store
        is added to ``new``, for :meth:`_put_all` to write."""
        if prior is not None and record.header.prior != prior:
            self._stats.count(Event.REFUSED, MissReason.NAMESPACE_REFUSED)
            return False
        problem = verify(record, self.layout, self.algo, name=slot[1], pool=slot[0])
        if problem:
            log.warning("refusing L3 record %s/%s: %s", slot[0], slot[1].hex(), problem)
            self._stats.count(Event.REFUSED, MissReason.VERIFICATION_FAILED)
            return False
        if slot in self._index and key_of(self._index[slot].header) == key_of(record.header):
            self._policy.touch(slot)   # names are content addresses: same name, same page
            return True
        if slot in self._index:   # sealed under another key (rotated, purged): replaced
            self._remove(slot)
        # NOTE: only a page the caller vouched for as the next of its chain (a prior to
        # check) may hang from the pages before it in ``names``; otherwise, its prior.
        here = at + i
        lo = here if prior is None else max(0, here - LINK_SCAN)
        earlier = (names[j] for j in range(here - 1, lo - 1, -1))
        self._index_add(slot, record.header, self._footprint(record),
                        link_of(slot[0], record.header.prior, earlier, self._index,
                                self._ghosts))
        if not self._fit_quota(slot):
            return False
        new.append((i, slot, record))
        self._evict_until(self.capacity_bytes)  # maybe the page itself
        return True

    def _index_add(self, slot: Slot, header: RecordHeader, size: int,
                   link: Link | None = None) -> None:
        link = link or Link((slot[0], header.prior), False)
        self._index[slot] = Entry(header, size)
        self._policy.add(slot, link.parent, orphan=link.orphan, owner=owner_of(header),
                         nbytes=size)
        self._used += size
        self._ghosts.pop(slot, None)
        if self.journal is not None and slot[0] == KV_POOL:
            self.journal.add(STORED, STORAGE_TIER, (slot[1],))

    def _evict_until(self, budget: int, keep: Container[Slot] = ()) -> None:
        """Evict tails first until at most ``budget`` bytes are held, or the next victim
        is one of ``keep`` (or there is none)."""
        self.pins.lapse(self._policy.release)
        while self._used > budget and (slot := self._policy.victim()) is not None \
                and slot not in keep:
            self._evict(slot)

    def _evict(self, slot: Slot) -> None:
        self._remove(slot)
        self._ghost(slot, MissReason.EVICTED)
        self._stats.count(Event.EVICTED)

    def _ghost(self, slot: Slot, reason: MissReason) -> None:
        self._ghosts[slot] = reason
        if len(self._ghosts) > GHOSTS:
            self._ghosts.popitem(last=False)

    def _remove(self, slot: Slot) -> None:
        entry = self._index.pop(slot, None)
        if entry is not None:
            self._used -= entry.nbytes
            if self.journal is not None and slot[0] == KV_POOL:
                self.journal.add(REMOVED, STORAGE_TIER, (slot[1],))
        self.pins.drop(slot)
        self._policy.remove(slot)
        self._delete(slot)


def _prefix_tail(info: ExtraInfo | None, algo: str) -> list[bytes]:
    """The last names of ``info.prefix_keys`` (already checked), where a chain is looked up."""
    if info is None or not info.prefix_keys:
        return []
    return normalize_keys(list(info.prefix_keys)[-LINK_SCAN:], algo, "extra_info.prefix_keys")
