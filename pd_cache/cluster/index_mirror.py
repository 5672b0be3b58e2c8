"""A front's own copy of the page index: routing reads it with no call.

Each front (an ingress replica, a ``PDCluster``) keeps a ``ShardCopy`` of every index shard,
fed off the request path by a daemon thread that long-polls each shard (``IndexActor.poll``)
for what changed since the version it holds::

    front's mirror thread                         index shard k
    poll(epoch, version, wait_s=1)        ->      waits for a change (<= 1 s), then
                                          <-      the names changed since, their masks now;
                                                  a snapshot for another epoch or a mirror
                                                  behind what its log keeps (index_feed)
    apply; wait POLL_GAP_S; poll again            (at most ~2 polls/s per shard and front)
    the call failed (the shard died):     ->      out of sync; poll again after RETRY_S

``IndexMirror.answer`` is the index's answer computed from the copies, or ``None`` while a
copy is out of sync: a shard not yet heard from, its last answer older than ``max_age_s``
(the feed failing or stuck), so a front routes from a copy at most ``max_age_s`` behind
its shard (a poll returns at least every ``WAIT_S``, and after every change). The caller
then asks the index, as without a mirror, and falls back to its hints. A stale entry costs
what it costs from the index itself: a page L3 no longer holds is a verified miss
(``stale_index``); a worker's page it evicted is recomputed; a page not yet mirrored is in
this front's hints if this front routed it. Memory: each copy holds at most ``bound``
entries (the shard's own bound, ``index_bound``).
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pd_cache.cluster.index import Holder, ShardView, answer, locate
from pd_cache.core.events import IndexAnswer, IndexChanges

log = logging.getLogger(__name__)

WAIT_S = 1.0        # a shard's long poll returns at least this often
# NOTE: between one answer and the next poll. At 50 ms (the publishers' flush period) a
# busy front polled ~20 times a second, and on 2 shared cores those wake-ups cost every
# hop of a request more than the query they replace (docs/peers.md, "The mirror").
POLL_GAP_S = 0.5
RETRY_S = 0.2       # after a failed poll


class ShardCopy:
    """One shard's entries as its last answer had them (plain logic; ``IndexMirror`` feeds
    it). Reads and updates may run on different threads: the entries and their holders are
    replaced together, and a delta's holders (an append-only list within an epoch) before
    its masks, so a reader never meets a bit it has no holder for."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.epoch, self.version = 0, 0
        self.state: tuple[dict[bytes, int], list[Holder]] = ({}, [])
        self.synced_at = float("-inf")   # when its last answer came (never: out of sync)
        self.counts = collections.Counter[str]()

    def apply(self, changes: IndexChanges, now: float) -> None:
        """Take ``changes`` (the shard's answer to ``epoch``, ``version``)."""
        holders = list(changes.holders)
        pairs = zip(changes.names, changes.masks)
        if changes.snapshot:
            masks = {name: mask for name, mask in pairs if mask}
            if len(masks) > self.bound:
                self.counts["dropped"] += len(masks) - self.bound
                masks = dict(list(masks.items())[:self.bound])
            self.state = (masks, holders)
            self.counts["snapshot"] += 1
        elif changes.epoch != self.epoch:   # a shard answers another epoch with a snapshot
            self.lost()
            return
        else:
            masks = self.state[0]
            self.state = (masks, holders)
            kept = []
            for name, mask in pairs:   # removals first: they make room under the bound
                if mask:
                    kept.append((name, mask))
                else:
                    masks.pop(name, None)
            for name, mask in kept:
                if name in masks or len(masks) < self.bound:
                    masks[name] = mask
                else:
                    self.counts["dropped"] += 1
            self.counts["delta"] += 1
        self.epoch, self.version, self.synced_at = changes.epoch, changes.version, now

    def lost(self) -> None:
        """The feed failed: out of sync until the next answer."""
        self.synced_at = float("-inf")
        self.counts["failed"] += 1

    def view(self, names: Sequence[bytes]) -> ShardView:
        masks, holders = self.state
        get = masks.get
        return ShardView([get(n, 0) for n in names], holders)

    def entries(self) -> int:
        return len(self.state[0])


class IndexMirror:
    """A copy of every index shard of ``shards`` (their actors), fed by a daemon thread
    (``start``); ``answer`` reads it."""

    def __init__(self, shards: Sequence[Any], bound: int, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shards, self.max_age_s, self.clock = list(shards), max_age_s, clock
        self.copies = [ShardCopy(bound) for _ in self.shards]
        self.counts = collections.Counter[str]()   # answered / unsynced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def answer(self, names: Sequence[bytes]) -> IndexAnswer | None:
        """The index's answer for ``names`` from the copies; ``None`` if one is out of sync."""
        now = self.clock()
        if any(now - c.synced_at > self.max_age_s for c in self.copies):
            self.counts["unsynced"] += 1
            return None
        self.counts["answered"] += 1
        asked, where = locate(names, len(self.copies))
        return answer([c.view(a) for c, a in zip(self.copies, asked)], where)

    def stats(self) -> dict[str, int]:
        """What the mirror did: answers, fallbacks, and its copies' snapshots, deltas and
        failed polls, summed; ``entries``: what the copies hold."""
        total = collections.Counter[str](self.counts)
        for c in self.copies:
            total.update(c.counts)
        return {**total, "entries": sum(c.entries() for c in self.copies)}

    def start(self) -> IndexMirror:
        self._thread = threading.Thread(target=self._run, name="index-mirror", daemon=True)
        self._thread.start()
        # NOTE: stopped before Ray's own exit handler (registered earlier, so run later):
        # a thread inside a Ray call while Ray shuts down takes the process with it.
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stop the feed and wait for its thread (at most one ``ray.wait``, WAIT_S / 2)."""
        self._stop.set()
        atexit.unregister(self.stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(WAIT_S)

    def _run(self) -> None:
        import ray

        pending: dict[Any, int] = {}             # poll in flight -> its shard
        due = [0.0] * len(self.shards)           # when each shard is polled next (inf: polled)
        while not self._stop.is_set() and ray.is_initialized():
            now = self.clock()
            for k, shard in enumerate(self.shards):
                if due[k] <= now:
                    copy = self.copies[k]
                    pending[shard.poll.remote(copy.epoch, copy.version, WAIT_S)] = k
                    due[k] = float("inf")
            if not pending:
                self._stop.wait(max(0.0, min(due) - now))
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT_S / 2)
            for ref in ready:
                k = pending.pop(ref)
                due[k] = self.clock() + self._take(k, ref)

    def _take(self, k: int, ref: Any) -> float:
        """Apply shard ``k``'s answer; the wait before its next poll."""
        import ray

        try:
            changes = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - dead or restarting: ask the index meanwhile
            log.debug("index mirror of shard %d: %s", k, exc)
            self.copies[k].lost()
            return RETRY_S
        self.copies[k].apply(changes, self.clock())
        return POLL_GAP_S
