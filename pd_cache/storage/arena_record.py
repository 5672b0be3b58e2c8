"""Records whose payloads live in an arena slot (``pd_cache.storage.arena``).

An :class:`ArenaRecord` is a :class:`PageRecord` that pickles as its header and where it
is (arena, slot, generation): a writer's set or a shard's lent answer carries a few hundred
bytes per page, and the process that unpickles it gets views of the slot in its own
mapping. Where that cannot be (the arena is gone, or the slot was freed or granted again
since), it gets a :class:`Lost` in the record's place: a miss, never other bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pd_cache.storage.arena import Arena, ArenaInfo, attached
from pd_cache.storage.record import PageRecord, RecordHeader, stored_nbytes, typed


class Where(msgspec.Struct, frozen=True, gc=False):
    """A record's slot: the arena, the slot, and the generation it was granted under."""

    arena: ArenaInfo
    slot: int
    gen: int


@dataclass(frozen=True, slots=True, eq=False)
class ArenaRecord(PageRecord):
    """A record in an arena slot; pickled as its header and :class:`Where`."""

    where: Where

    def __reduce__(self) -> tuple[Any, ...]:
        return from_arena, (self.header, self.where)


@dataclass(frozen=True, slots=True)
class Lost:
    """An arena record that could not be mapped where it was unpickled (a miss)."""

    name: bytes
    detail: str


def slot_payloads(arena: Arena, slot: int, header: RecordHeader) -> tuple[Any, ...] | None:
    """Views of ``header``'s payloads, one after another in ``slot``; ``None`` if they do
    not fit (a header that is not the slot's)."""
    sealed = header.seal is not None
    sizes = [stored_nbytes(e, sealed) for e in header.pools]
    if min(sizes, default=0) < 0 or sum(sizes) > arena.info.slot_bytes:
        return None
    view, out, at = arena.view(slot), [], 0
    for entry, size in zip(header.pools, sizes):
        out.append(typed(view[at:at + size], entry, sealed))
        at += size
    return tuple(out)


def from_arena(header: RecordHeader, where: Where) -> ArenaRecord | Lost:
    """The record at ``where`` as views of this process's mapping, if it is still whole."""
    arena = attached(where.arena)
    if arena is None:
        return Lost(header.name, f"arena {where.arena.id.hex()} cannot be mapped here")
    if arena.word(where.slot) != where.gen:
        return Lost(header.name, f"arena slot {where.slot} was freed")
    payloads = slot_payloads(arena, where.slot, header)
    if payloads is None:
        return Lost(header.name, f"record does not fit arena slot {where.slot}")
    return ArenaRecord(header, payloads, where)
