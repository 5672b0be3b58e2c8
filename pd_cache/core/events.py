"""KV events: what a publisher (a worker, an L3 shard) stored and removed, for the page index.

Names only (no tokens; a name carries its namespace). A publisher appends to its
``EventLog`` on the hot path (one list append per batch of names) and a ``Publisher``
thread drains it off the path into one ``EventBatch`` per index shard::

    publisher (epoch e, its process)      index shard k
    log.add(STORED, "device", names)
    ... every flush_s:  batch(e, seq=s)  ->  apply if (e, s) is the next one: True
                                             a gap or another epoch:        False
                        False            ->  snapshot(e, seq=s+1): everything held, replaces

A stored or removed page applied twice changes nothing, so a snapshot walked while the
engine runs is exact once the events logged since its drain are applied after it.
A new epoch (a restarted process) drops what the old one published.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

log = logging.getLogger(__name__)

STORED, REMOVED = True, False
STORAGE_TIER = "storage"   # every L3 shard publishes its pages under this tier


class PagesStored(msgspec.Struct, frozen=True, gc=False, tag="stored"):
    tier: str
    names: list[bytes]


class PagesRemoved(msgspec.Struct, frozen=True, gc=False, tag="removed"):
    tier: str
    names: list[bytes]


KVEvent = PagesStored | PagesRemoved


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One publisher's events for one index shard; ``snapshot``: everything it holds
    there (what it published before is replaced)."""

    publisher: str
    epoch: int
    seq: int
    events: list[KVEvent]
    snapshot: bool = False
    sent_at: float = 0.0   # wall clock of its oldest event (lag = applied - sent_at)


class WorkerHit(msgspec.Struct, frozen=True, gc=False):
    """The leading pages of a request one worker holds: on device, then on host."""

    device: int
    host: int

    @property
    def pages(self) -> int:
        return self.device + self.host


class IndexAnswer(msgspec.Struct, frozen=True, gc=False):
    """For a request's names: each publisher's longest cached prefix by tier (publishers
    that hold none are left out) and the leading pages L3 holds (``l3_pages``)."""

    workers: dict[str, WorkerHit]
    l3_pages: int


class IndexChanges(msgspec.Struct, frozen=True, gc=False):
    """What an index shard's entries are now, for a front's mirror of it: the entries of
    ``names`` changed since the version the mirror asked from (``snapshot``: every entry,
    replacing its copy), each name's holder mask (0: gone), and the holders' bits, under
    the shard's ``epoch`` (a restarted shard has a new one) at ``version``."""

    epoch: int
    version: int
    holders: list[tuple[str, str]]
    names: list[bytes]
    masks: list[int]
    snapshot: bool = False


def shard_of(name: bytes, num_shards: int) -> int:
    """The index shard that keeps ``name`` (names are uniform hashes: their last bytes do)."""
    return int.from_bytes(name[-4:], "little") % num_shards if num_shards > 1 else 0


def new_epoch() -> int:
    return int.from_bytes(os.urandom(7), "little")


class EventLog:
    """The events one publisher has not sent yet; ``add`` is all the hot path does."""

    def __init__(self) -> None:
        self._pending: list[tuple[bool, str, Sequence[bytes]]] = []
        self._swap = threading.Lock()
        self.oldest = 0.0   # when the oldest pending entry was added (wall clock)

    def add(self, stored: bool, tier: str, names: Sequence[bytes]) -> None:
        if names:
            if not self._pending:
                self.oldest = time.time()
            self._pending.append((stored, tier, names))

    def drain(self) -> list[tuple[bool, str, Sequence[bytes]]]:
        with self._swap:
            out, self._pending = self._pending, []
        return out


def split(entries: Iterable[tuple[bool, str, Sequence[bytes]]],
          num_shards: int) -> list[list[KVEvent]]:
    """``entries`` as events per shard, in order (runs of one kind and tier merged)."""
    out: list[list[KVEvent]] = [[] for _ in range(num_shards)]
    for stored, tier, names in entries:
        kind = PagesStored if stored else PagesRemoved
        per: list[list[bytes]] = [[] for _ in range(num_shards)]
        for name in names:
            per[shard_of(name, num_shards)].append(name)
        for k, some in enumerate(per):
            if not some:
                continue
            last = out[k][-1] if out[k] else None
            if type(last) is kind and last.tier == tier:
                last.names.extend(some)
            else:
                out[k].append(kind(tier, some))
    return out


Send = Callable[[int, EventBatch], bool]        # (shard, batch) -> accepted; raises if lost
Held = Callable[[], Mapping[str, Iterable[bytes]]]   # tier -> every name held there


class Publisher:
    """Sends one ``EventLog`` to the index shards every ``flush_s`` on a daemon thread, and
    an empty batch after ``heartbeat_s`` of silence (a restarted shard then asks for a
    snapshot: an idle publisher is not forgotten).

    ``send`` returns the shard's answer (``False``: it wants a snapshot) and raises if the
    shard could not be reached (then a snapshot follows too); ``held`` lists what the
    publisher holds, per tier, for a snapshot."""

    def __init__(self, name: str, log_: EventLog, num_shards: int, send: Send, held: Held,
                 flush_s: float = 0.05, heartbeat_s: float = 1.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.name, self.log, self.num_shards = name, log_, num_shards
        self.send, self.held, self.flush_s, self.heartbeat_s = send, held, flush_s, heartbeat_s
        self.clock = clock or time.time
        self._last = [0.0] * num_shards   # when each shard last heard from this publisher
        self.epoch = new_epoch()
        self.seq = [0] * num_shards
        self.stale = [True] * num_shards   # the shard needs a snapshot first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Publisher:
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def flush(self) -> None:
        """Send what was logged (or a snapshot where a shard wants one)."""
        now, oldest, entries = self.clock(), self.log.oldest, self.log.drain()
        events = split(entries, self.num_shards)
        since = min(now, oldest) if entries else now
        held = self._snapshot() if any(self.stale) else None
        for k in range(self.num_shards):
            if self.stale[k] and held is not None:
                self._send(k, EventBatch(self.name, self.epoch, self.seq[k], held[k], True, now))
            elif not self.stale[k] and (events[k] or now - self._last[k] >= self.heartbeat_s):
                self._send(k, EventBatch(self.name, self.epoch, self.seq[k], events[k], False,
                                         since if events[k] else now))

    def _snapshot(self) -> list[list[KVEvent]] | None:
        try:
            return split(((STORED, tier, list(names)) for tier, names in self.held().items()),
                         self.num_shards)
        except RuntimeError as exc:   # NOTE: the tree changed under the walk: next time
            log.debug("snapshot of %s: %s", self.name, exc)
            return None

    def _send(self, shard: int, batch: EventBatch) -> None:
        self.seq[shard] += 1
        self._last[shard] = self.clock()
        try:
            accepted = self.send(shard, batch)
        except Exception as exc:  # noqa: BLE001 - lost or not: the shard gets a snapshot
            log.debug("kv events of %s to index shard %d: %s", self.name, shard, exc)
            accepted = False
        self.stale[shard] = not accepted
