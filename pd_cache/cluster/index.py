"""The cluster page index: which worker holds which page in which tier, and what L3 holds.

Fed by KV events (``pd_cache.core.events``) from every worker and L3 shard; sharded by
name over one or a few actors (``shard_of``). One entry per name: a bit mask of its holders,
one bit per (publisher, tier)::

    masks[name] = 0b0101     holders[0] = ("prefill-0", "device")
                             holders[2] = ("decode-1", "host")

Memory is bounded: publishers only report what their pools and L3 hold, and past
``max_entries`` a new name is not indexed (counted ``dropped``): a hint missing, never a
wrong one. A publisher's new epoch (its process restarted) drops what the old one
published, at once. Each front keeps a mirror of every shard (``index_mirror``), fed by
``changes`` (``index_feed``): what changed since the version it holds, or a snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from pd_cache.cluster.index_feed import ChangeLog
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.events import (
    STORAGE_TIER,
    EventBatch,
    IndexAnswer,
    IndexChanges,
    KVEvent,
    PagesStored,
    WorkerHit,
    shard_of,
)
from pd_cache.core.fields import check_int_at_least

Holder = tuple[str, str]   # (publisher, tier)
LAGS = 100_000             # apply lags kept (the benchmark reads them)


class ShardView(NamedTuple):
    """One index shard's answer: per name asked, its holders' bit mask; the bits' owners."""

    masks: list[int]
    holders: list[Holder]


class PageIndex:
    """One shard of the index (plain logic; ``IndexActor`` hosts it in Ray)."""

    def __init__(self, max_entries: int = 1 << 24) -> None:
        check_int_at_least("max_entries", max_entries, 1)
        self.max_entries = max_entries
        self.masks: dict[bytes, int] = {}
        self.holders: list[Holder] = []
        self._bit: dict[Holder, int] = {}
        self._pubs: dict[str, tuple[int, int]] = {}   # publisher -> (epoch, next seq)
        self.lags: collections.deque[float] = collections.deque(maxlen=LAGS)
        self.counts = collections.Counter[str]()
        # NOTE: a mirror behind by more changed names than an eighth of the bound takes a
        # snapshot, about the cost of the deltas it missed; the log stays a small share.
        self.feed = ChangeLog(max(1024, max_entries // 8))

    def publish(self, batch: EventBatch) -> bool:
        """Apply ``batch``; ``False``: it does not follow the last one applied (a gap, a
        new epoch, an unknown publisher) and the publisher must send a snapshot."""
        known = self._pubs.get(batch.publisher)
        if batch.snapshot:
            self._forget(batch.publisher)
        elif known is None or known[0] != batch.epoch:
            if known is not None:   # its process restarted: what it held is gone
                self._forget(batch.publisher)
            self.counts["refused"] += 1
            return False
        elif known[1] != batch.seq:
            self.counts["gap"] += 1
            return False
        self._apply(batch.publisher, batch.events)
        self._pubs[batch.publisher] = (batch.epoch, batch.seq + 1)
        self.counts["snapshot" if batch.snapshot else "batch"] += 1
        if batch.sent_at:
            self.lags.append(time.time() - batch.sent_at)
        return True

    def query(self, names: Sequence[bytes]) -> ShardView:
        self.counts["query"] += 1
        get = self.masks.get
        return ShardView([get(n, 0) for n in names], list(self.holders))

    def changes(self, epoch: int, since: int) -> IndexChanges:
        """What changed after version ``since`` of ``epoch`` (a mirror's), else a snapshot."""
        feed, get = self.feed, self.masks.get
        names = feed.since(since) if epoch == feed.epoch else None
        if names is None:
            self.counts["mirror_snapshot"] += 1
            return IndexChanges(feed.epoch, feed.version, list(self.holders), list(self.masks),
                                list(self.masks.values()), True)
        self.counts["mirror_delta"] += 1
        touched = list(names)
        return IndexChanges(feed.epoch, feed.version, list(self.holders), touched,
                            [get(n, 0) for n in touched])

    def entries(self) -> int:
        return len(self.masks)

    def _apply(self, publisher: str, events: Sequence[KVEvent]) -> None:
        masks = self.masks
        for event in events:
            bit = 1 << self._bit_of((publisher, event.tier))
            self.feed.add(event.names)
            if isinstance(event, PagesStored):
                for name in event.names:
                    old = masks.get(name)
                    if old is not None:
                        masks[name] = old | bit
                    elif len(masks) < self.max_entries:
                        masks[name] = bit
                    else:
                        self.counts["dropped"] += 1
            else:
                for name in event.names:
                    old = masks.get(name, 0) & ~bit
                    if old:
                        masks[name] = old
                    else:
                        masks.pop(name, None)

    def _bit_of(self, holder: Holder) -> int:
        bit = self._bit.get(holder)
        if bit is None:
            bit = self._bit[holder] = len(self.holders)
            self.holders.append(holder)
        return bit

    def _forget(self, publisher: str) -> None:
        """Drop every entry ``publisher`` made (one pass over the index)."""
        if self._pubs.pop(publisher, None) is None:
            return
        gone = sum(1 << b for (p, _), b in self._bit.items() if p == publisher)
        if not gone:
            return
        keep, changed = ~gone, []
        for name, mask in list(self.masks.items()):
            if mask & gone:
                changed.append(name)
                if mask & keep:
                    self.masks[name] = mask & keep
                else:
                    del self.masks[name]
        self.feed.add(changed)


def locate(names: Sequence[bytes], num_shards: int) -> tuple[list[list[bytes]],
                                                           list[tuple[int, int]]]:
    """The names each shard is asked about, and where each of ``names`` is among them
    (``(shard, position)``, what ``answer`` takes)."""
    asked: list[list[bytes]] = [[] for _ in range(num_shards)]
    where = []
    for name in names:
        k = shard_of(name, num_shards)
        where.append((k, len(asked[k])))
        asked[k].append(name)
    return asked, where


def answer(views: Sequence[ShardView], where: Sequence[tuple[int, int]]) -> IndexAnswer:
    """The answer for a request's names from its shards' ``views``; ``where[i]`` is name
    ``i``'s (shard, position in that shard's view)."""
    held = [_holders(views[s], views[s].masks[j]) for s, j in where]
    l3 = next((i for i, h in enumerate(held) if not any(t == STORAGE_TIER for _, t in h)),
              len(held))
    workers = {}
    for pub in {p for h in held for p, t in h if t != STORAGE_TIER}:
        device = pages = 0
        for h in held:
            tiers = {t for p, t in h if p == pub}
            if not tiers:
                break
            pages += 1
            device += device == pages - 1 and "device" in tiers
        if pages:
            workers[pub] = WorkerHit(device, pages - device)
    return IndexAnswer(workers, l3)


def _holders(view: ShardView, mask: int) -> list[Holder]:
    out, bit = [], 0
    while mask:
        if mask & 1:
            out.append(view.holders[bit])
        mask >>= 1
        bit += 1
    return out


class IndexActor(PageIndex):
    """The Ray actor of one index shard: ``PageIndex``, its query counter, and the mirrors'
    long poll (an async actor: its methods run one at a time on its event loop)."""

    def __init__(self, max_entries: int) -> None:
        from pd_cache.metrics import PDCacheMetrics

        super().__init__(max_entries)
        self.metrics = PDCacheMetrics("auto")
        self._changed: asyncio.Event | None = None   # set at the next version

    async def publish(self, batch: EventBatch) -> bool:  # type: ignore[override]
        version = self.feed.version
        accepted = super().publish(batch)
        if self.feed.version != version and self._changed is not None:
            self._changed.set()
            self._changed = None
        return accepted

    async def query(self, names: Sequence[bytes]) -> ShardView:  # type: ignore[override]
        self.metrics.count_index_queries()
        return super().query(names)

    async def poll(self, epoch: int, since: int, wait_s: float) -> IndexChanges:
        """``changes``, once there are any after ``since`` or ``wait_s`` passed (a long
        poll: an idle mirror asks once per ``wait_s``)."""
        if wait_s > 0 and epoch == self.feed.epoch and since == self.feed.version:
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                pass
        return self.changes(epoch, since)

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self.masks), "publishers": sorted(self._pubs),
                **self.counts}

    def take_lags(self) -> list[float]:
        out = list(self.lags)
        self.lags.clear()
        return out

    def pid(self) -> int:
        import os

        return os.getpid()

    def rss(self) -> int:
        """This process's resident bytes (the benchmark's memory figure)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def footprint(self) -> int:
        """Bytes Python counts for the entries: the dict, its keys, masks not shared."""
        import sys

        size = sys.getsizeof(self.masks)
        for name, mask in self.masks.items():
            size += sys.getsizeof(name) + (sys.getsizeof(mask) if mask > 256 else 0)
        return size


def index_bound(config: ClusterConfig) -> int:
    """Entries one shard may hold: what every worker's L1 and L2 and L3 can hold, over the
    shards, twice (a publisher's snapshot may arrive before its removals)."""
    pages = (config.num_prefill + config.num_decode) * (config.device_pages + config.host_pages)
    if config.with_storage:
        pages += config.storage_capacity_bytes // config.pd_config.layout.page_nbytes
    return max(1, 2 * pages // max(1, config.index_shards))


def index_actors(num_shards: int, max_entries: int, name: str, namespace: str, *,
                 detached: bool) -> list[Any]:
    """One named ``IndexActor`` per shard (``{name}-{i}``), always restarted when killed
    (it comes back empty and the publishers' snapshots fill it again)."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "max_restarts": -1,
                               "namespace": namespace, "get_if_exists": True}
    if detached:
        options["lifetime"] = "detached"
    cls = ray.remote(IndexActor)
    return [cls.options(name=f"{name}-{i}", **options).remote(max_entries)
            for i in range(num_shards)]
