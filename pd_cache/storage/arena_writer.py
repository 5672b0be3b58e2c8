"""The writer's side of the arenas: slots to seal records into, from a client's shards.

Before a set, :meth:`ArenaWriter.grant` asks each shard its pages go to (one call per
shard, side by side) for a slot per record; a shard on another Ray node, a ``disk`` shard or
one without free slots grants none, and those records take the usual path (sealed into
the writer's buffer, copied into the object store by the set). A sealed record is
:func:`committed` to its slot (its commit word written) before the set is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pd_cache.storage.arena import Arena, ArenaInfo, attached, forget, this_node
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


class ArenaWriter:
    """Grants from the arenas of ``client``'s shards on this Ray node, mapped once each."""

    def __init__(self, client: StorageClient) -> None:
        self.client, self.node = client, this_node()
        self._without: set[int] = set()    # shards that have no arena for this process
        self._ids: dict[int, bytes] = {}   # shard -> the arena it last granted from

    def grant(self, transfers: Sequence[PoolTransfer], extra_info: ExtraInfo | None,
              sizes: Sequence[int]) -> list[Slotted | None]:
        """Per page of ``transfers`` (in order; ``sizes``: each sealed), its slot or
        ``None``. A shard that fails or is slow to answer grants nothing this time."""
        import time

        import ray

        batches = check_batch(transfers, extra_info, self.client.algo, with_pages=True)
        starts = [0]
        for b in batches:
            starts.append(starts[-1] + len(b.keys))
        asks = {s: [starts[j] + i for j, pos in parts for i in pos]
                for s, parts in self.client.plan(batches, extra_info).items()
                if s not in self._without}
        refs = {s: self.client.handles[s].arena_grant.remote([sizes[k] for k in ks], self.node)
                for s, ks in asks.items()}
        timeout = self.client.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Slotted | None] = [None] * len(sizes)
        for s, ref in refs.items():
            try:
                grant = ray.get(ref, timeout=remaining(deadline))
            except ray.exceptions.RayError:
                continue
            arena = None if grant.arena is None else self._arena(s, grant.arena)
            if arena is None:
                self._without.add(s)
                continue
            for k, got in zip(asks[s], grant.slots):
                if got is not None:
                    out[k] = Slotted(arena, *got)
        return out

    def _arena(self, shard: int, info: ArenaInfo) -> Arena | None:
        old = self._ids.get(shard)
        if old is not None and old != info.id:   # NOTE: the shard restarted: a new arena
            forget([old])
        self._ids[shard] = info.id
        return attached(info)


def committed(record: PageRecord, slotted: Slotted) -> ArenaRecord:
    """``record``, sealed into ``slotted``'s slot, marked whole there (its commit word).
    A payload sealed elsewhere (an AEAD that cannot write in place) is copied in first."""
    at = 0
    for payload in record.payloads:
        n = payload.numel() * payload.element_size()
        view = slotted.arena.view(slotted.slot, at + n)[at:]
        if payload.data_ptr() != view.data_ptr():
            view.copy_(payload.view(-1).view(torch.uint8))
        at += n
    slotted.arena.set_word(slotted.slot, slotted.gen)
    return ArenaRecord(record.header, record.payloads,
                       Where(slotted.arena.info, slotted.slot, slotted.gen))


def committed_all(records: Sequence[PageRecord], slots: Sequence[Slotted | None]) -> list[Any]:
    return [r if s is None else committed(r, s) for r, s in zip(records, slots)]
