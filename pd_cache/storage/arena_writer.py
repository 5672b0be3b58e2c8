"""The writer's side of the arenas: slots to seal records into, from a client's shards.

Before a set, :meth:`ArenaWriter.grant` asks each shard its pages go to (one call per
shard, side by side) for a slot per record; a shard on another Ray node, a ``disk`` shard or
one without free slots grants none, and those records take the usual path (sealed into
the writer's buffer, copied into the object store by the set). A sealed record is
:func:`committed` to its slot (its commit word written) before the set is sent.

Each call also asks for ``lease_ahead`` spare slots (free ones only: the shard evicts
nothing for them), kept per shard (:class:`Leases`) for the next sets, which take their
slots from there with no call, until the lease is half over (``LEASE_S``: the shard frees
a grant never adopted after it) or the shard's process is gone. An ``arena_grant`` call
costs about 1 ms of CPU, caller and shard together; a lease of 64 spares it for the next
64 pages.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pd_cache.storage.arena import (
    LEASE_S,
    Arena,
    ArenaInfo,
    attached,
    forget,
    this_node,
)
from pd_cache.storage.arena_record import ArenaRecord, Where
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.batch import check_batch
from pd_cache.storage.reader import remaining
from pd_cache.storage.record import PageRecord

if TYPE_CHECKING:
    from pd_cache.storage.client import StorageClient


class Slotted(NamedTuple):
    """A slot granted for one record: where to seal it."""

    arena: Arena
    slot: int
    gen: int

    def view(self, nbytes: int) -> torch.Tensor:
        self.arena.prepare(self.slot)
        return self.arena.view(self.slot, nbytes)


LEASE_AHEAD = 64   # spare slots a writer asks each shard for with every grant call


class Leases:
    """Slots one shard granted ahead of need, each usable until its deadline (half the
    shard's lease, on this process's clock); pure bookkeeping, first granted first used."""

    def __init__(self) -> None:
        self._slots: deque[tuple[int, int, float]] = deque()

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, slots: Sequence[tuple[int, int]], asked_at: float) -> None:
        """``(slot, generation)`` pairs a grant asked for at ``asked_at`` gave ahead."""
        deadline = asked_at + LEASE_S / 2
        self._slots.extend((slot, gen, deadline) for slot, gen in slots)

    def take(self, n: int, now: float) -> list[tuple[int, int]] | None:
        """``n`` slots still good at ``now`` (those past their deadline dropped), or
        ``None`` (and none taken) if it holds fewer."""
        while self._slots and self._slots[0][2] <= now:
            self._slots.popleft()
        if len(self._slots) < n:
            return None
        return [self._slots.popleft()[:2] for _ in range(n)]

    def clear(self) -> None:
        self._slots.clear()


class ArenaWriter:
    """Grants from the arenas of ``client``'s shards on this Ray node, mapped once each;
    ``lease_ahead`` spare slots asked with each grant call (0: none). Used by one thread
    at a time (``SealedStorage.submit_set_v2`` holds its lock around it)."""

    def __init__(self, client: StorageClient, lease_ahead: int = LEASE_AHEAD) -> None:
        self.client, self.node, self.lease_ahead = client, this_node(), lease_ahead
        self._without: set[int] = set()    # shards that have no arena for this process
        self._ids: dict[int, bytes] = {}   # shard -> the arena it last granted from
        self._arenas: dict[int, Arena] = {}      # shard -> that arena, mapped here
        self._leases: dict[int, Leases] = {}     # shard -> its spare slots

    def grant(self, transfers: Sequence[PoolTransfer], extra_info: ExtraInfo | None,
              sizes: Sequence[int]) -> list[Slotted | None]:
        """Per page of ``transfers`` (in order; ``sizes``: each sealed), its slot or
        ``None``: from the shard's lease when it holds enough, else from a call. A shard
        that fails or is slow to answer grants nothing this time."""
        import ray

        batches = check_batch(transfers, extra_info, self.client.algo, with_pages=True)
        starts = [0]
        for b in batches:
            starts.append(starts[-1] + len(b.keys))
        asks = {s: [starts[j] + i for j, pos in parts for i in pos]
                for s, parts in self.client.plan(batches, extra_info).items()
                if s not in self._without}
        out: list[Slotted | None] = [None] * len(sizes)
        now = time.monotonic()
        asks = {s: rest for s, ks in asks.items() if (rest := self._leased(s, ks, sizes, out, now))}
        refs = {s: self.client.handles[s].arena_grant.remote(
            [sizes[k] for k in ks], self.node, self._spare(s)) for s, ks in asks.items()}
        timeout = self.client.timeout_s
        deadline = None if timeout is None else now + timeout
        for s, ref in refs.items():
            try:
                grant = ray.get(ref, timeout=remaining(deadline))
            except ray.exceptions.RayError:
                continue
            arena = None if grant.arena is None else self._arena(s, grant.arena)
            if arena is None:
                self._without.add(s)
                continue
            self._leases.setdefault(s, Leases()).add(grant.spare, now)
            for k, got in zip(asks[s], grant.slots):
                if got is not None:
                    out[k] = Slotted(arena, *got)
        return out

    def _spare(self, shard: int) -> int:
        """Spare slots to ask ``shard`` for: its lease topped up to ``lease_ahead``."""
        return max(0, self.lease_ahead - len(self._leases.get(shard, ())))

    def _leased(self, shard: int, ks: list[int], sizes: Sequence[int],
                out: list[Slotted | None], now: float) -> list[int]:
        """Fill ``out[k]`` for the pages ``ks`` of ``shard`` from its lease if it holds a
        slot for each (a record too big for a slot needs none); the pages still to ask
        for (all of them, unless the lease covered them)."""
        arena, leases = self._arenas.get(shard), self._leases.get(shard)
        if arena is None or leases is None:
            return ks
        if not arena.alive:   # NOTE: the shard died: its slots are nobody's
            leases.clear()
            return ks
        fit = [k for k in ks if 0 < sizes[k] <= arena.info.slot_bytes]
        got = leases.take(len(fit), now)
        if got is None:   # NOTE: not enough: all asked for, the lease kept for later
            return ks
        for k, slot in zip(fit, got):
            out[k] = Slotted(arena, *slot)
        return []

    def _arena(self, shard: int, info: ArenaInfo) -> Arena | None:
        old = self._ids.get(shard)
        if old is not None and old != info.id:   # NOTE: the shard restarted: a new arena
            forget([old])
            self._leases.pop(shard, None)
        self._ids[shard] = info.id
        arena = attached(info)
        if arena is None:
            self._arenas.pop(shard, None)
            self._leases.pop(shard, None)
        else:
            self._arenas[shard] = arena
        return arena


def committed(record: PageRecord, slotted: Slotted) -> ArenaRecord:
    """``record``, sealed into ``slotted``'s slot (every AEAD writes there in place:
    ``storage.cipher``), marked whole there (its commit word)."""
    slotted.arena.set_word(slotted.slot, slotted.gen)
    return ArenaRecord(record.header, record.payloads,
                       Where(slotted.arena.info, slotted.slot, slotted.gen))


def committed_all(records: Sequence[PageRecord], slots: Sequence[Slotted | None]) -> list[Any]:
    return [r if s is None else committed(r, s) for r, s in zip(records, slots)]
