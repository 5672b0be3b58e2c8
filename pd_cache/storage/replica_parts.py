"""Pure pieces of the replicated client (``storage.replicas``): which parts of a batch to
ask the next replica for, and how the replicas' answers merge.

A part is one pool's run of keys that one replica is asked for (a read that missed) or
given (a repair). With a chain (``prefix_keys`` set) a part is a run of consecutive keys,
sent with the chain's names before it, so that it is placed as the whole batch was::

    op keys    k0 k1 k2 k3 k4 k5          missed on replica 0: k2 k3 k5
    parts      (kv, [2, 3]) (kv, [5])     prefix_keys + [k0 k1], prefix_keys + [k0 .. k4]

Without a chain each page is placed by its own name: a part is every such key of a pool.
``ReplicaRead`` is one get's state as the ranks answer it (which rank served each page).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from pd_cache.storage.base import (
    ExtraInfo,
    Pending,
    PoolHits,
    PoolTransfer,
    ShardFault,
    pool_start,
)
from pd_cache.storage.batch import Batch, usable_hits
from pd_cache.storage.record import CHECKPOINT_POOLS


class Part(NamedTuple):
    """Pool ``pool`` (index ``j`` in the call), its keys at ``positions``."""

    j: int
    pool: str
    positions: list[int]


def runs(positions: Sequence[int]) -> list[list[int]]:
    """``positions`` (ascending) cut into runs of consecutive ones."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][-1] == p - 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def parts(transfers: Sequence[PoolTransfer], wanted: Sequence[Sequence[bool]],
          chained: bool) -> list[Part]:
    """The parts that cover every key marked in ``wanted[j]`` (per transfer, per key)."""
    out = []
    for j, (t, marks) in enumerate(zip(transfers, wanted)):
        positions = [i for i, w in enumerate(marks) if w]
        for run in runs(positions) if chained else ([positions] if positions else []):
            out.append(Part(j, t.pool, run))
    return out


def part_call(transfers: Sequence[PoolTransfer], part: Part, info: ExtraInfo | None,
              pages: Sequence[Any] | None = None) -> tuple[list[PoolTransfer], ExtraInfo | None]:
    """The one-pool call that asks for (or, with ``pages``, stores) ``part``: its keys and,
    with a chain, the names before them as its ``prefix_keys``."""
    t = transfers[part.j]
    keys = [t.keys[i] for i in part.positions]
    sent = None if pages is None else [pages[i] for i in part.positions]
    if info is None or info.prefix_keys is None:
        return [PoolTransfer(t.pool, keys, sent)], info
    op = max((x.keys for x in transfers), key=len)
    before = (pool_start(op, t.keys) or 0) + part.positions[0]
    prefix = [*info.prefix_keys, *op[:before]]
    return [PoolTransfer(t.pool, keys, sent)], msgspec.structs.replace(info, prefix_keys=prefix)


def presence(batches: Sequence[Batch], plan: dict[int, list[tuple[int, list[int]]]],
             answers: dict[int, PoolHits]) -> list[list[bool]]:
    """Per pool of an ``exists``, which keys the shards that answered hold: a shard's hits
    are the first of its keys; a checkpoint pool's are marked key by key."""
    marks = [[False] * len(b.keys) for b in batches]
    for s, shard_parts in plan.items():
        if s not in answers:
            continue
        for j, pos in shard_parts:
            pool = batches[j].pool
            stored = (answers[s].checkpoints or {}).get(pool)
            if stored is None:
                stored = [True] * answers[s].per_pool.get(pool, 0)
            for i, ok in zip(pos, stored):
                marks[j][i] = ok
    return marks


def joined_hits(batches: Sequence[Batch], each: Sequence[list[list[bool]]]) -> PoolHits:
    """The hits of every replica's ``presence`` together: a key is held if one holds it."""
    marks = [[any(m[j][i] for m in each) for i in range(len(b.keys))]
             for j, b in enumerate(batches)]
    per_pool = {b.pool: next((i for i, ok in enumerate(m) if not ok), len(m))
                for b, m in zip(batches, marks)}
    return usable_hits(batches, per_pool,
                       {b.pool: m for b, m in zip(batches, marks) if b.pool in CHECKPOINT_POOLS})


class ReplicaRead:
    """One replicated get as it goes: rank 0's answer ``got`` (its pools and keys), the page
    found for each key so far and the rank that served it (``None``: none yet)::

        floor[j][i]  the rank whose copy of key i was missed or rejected: the key is asked
                     of the ranks after it (``None``: not asked again)
    """

    def __init__(self, got: Sequence[PoolTransfer], info: ExtraInfo | None) -> None:
        self.got, self.info = list(got), info
        self.chained = info is not None and info.prefix_keys is not None
        self.pages = [list(t.pages or [None] * len(t.keys)) for t in got]
        self.served: list[list[int | None]] = [[None if p is None else 0 for p in ps]
                                               for ps in self.pages]

    def missed(self) -> list[list[int | None]]:
        """The floor of a read whose rank 0 answered: every key it missed, after rank 0."""
        return [[0 if p is None else None for p in ps] for ps in self.pages]

    def rejected(self, bad: Sequence[Sequence[bool]]) -> list[list[int | None]]:
        """Drop the pages ``bad`` (a copy served them, they failed above the client): the
        floor that asks the ranks after the one that served each."""
        floor: list[list[int | None]] = [[None] * len(t.keys) for t in self.got]
        for j, marks in enumerate(bad):
            for i, b in enumerate(marks):
                if b and self.served[j][i] is not None:
                    floor[j][i], self.served[j][i] = self.served[j][i], None
                    self.pages[j][i] = None
        return floor

    def asked(self, floor: Sequence[Sequence[int | None]], rank: int) -> list[list[bool]]:
        """The keys to ask ``rank`` for: still missing, floor below it."""
        return [[f is not None and f < rank and p is None for f, p in zip(fs, ps)]
                for fs, ps in zip(floor, self.pages)]

    def filled(self, floor: Sequence[Sequence[int | None]], below: int) -> list[list[bool]]:
        """The keys a rank after their floor served, that rank ``below`` lacks (it is
        before the one that served them): what to write back to ``below``."""
        return [[f is not None and s is not None and s > f and s > below
                 for f, s in zip(fs, ss)] for fs, ss in zip(floor, self.served)]

    def answer(self, floor: Sequence[Sequence[int | None]] | None = None) -> list[PoolTransfer]:
        """The pages found (with ``floor``: only those of the keys it asks again)."""
        return [PoolTransfer(t.pool, t.keys, list(ps) if floor is None else
                             [p if f is not None else None for p, f in zip(ps, fs)])
                for t, ps, fs in zip(self.got, self.pages, floor or self.pages)]


class AllOf(Pending[Any]):
    """Several pendings, their results combined by ``combine``."""

    def __init__(self, calls: list[Pending[Any]], combine: Callable[[list[Any]], Any]) -> None:
        self._calls, self._combine = calls, combine

    def done(self) -> bool:
        return all(c.done() for c in self._calls)

    def result(self, timeout: float | None = None) -> Any:
        return self._combine([c.result(timeout) for c in self._calls])

    @property
    def faults(self) -> list[ShardFault]:
        return [f for c in self._calls for f in c.faults]
