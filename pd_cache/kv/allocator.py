"""Slot allocation with an owner recorded for every slot (pure logic, no tensors)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pd_cache.kv.base import PoolFullError, SlotError

MAX_LISTED = 8


class SlotAllocator:
    """Hands out slots ``0 .. capacity - 1`` and remembers who holds each one.

    ``free`` checks every slot before changing anything, so a bad call leaves the
    allocator as it was. Free slots form a stack (the last freed is reused first), so a
    run is deterministic.
    """

    def __init__(self, capacity: int, name: str = "pool") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"{name}.capacity: expected an int >= 0, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._owner: list[str | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))   # pop() gives 0, 1, 2, ... at first
        self._closed = False

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int, owner: str) -> list[int]:
        """``n`` slots now owned by ``owner``; ``PoolFullError`` if fewer are free."""
        self._check_open()
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{self.name}.alloc: n: expected an int >= 0, got {n!r}")
        _check_owner(self.name, owner)
        if n > len(self._free):
            raise PoolFullError(f"{self.name}: cannot allocate {n} slots for {owner!r}: "
                                f"{len(self._free)} of {self.capacity} free")
        slots = [self._free.pop() for _ in range(n)]
        for s in slots:
            self._owner[s] = owner
        return slots

    def free(self, slots: Iterable[int], owner: str) -> None:
        """Return ``slots``; each must be held by ``owner``, and listed once."""
        self._check_open()
        slots = list(slots)
        self._check_free(slots, owner)
        for s in slots:
            self._owner[s] = None
        self._free.extend(sorted(slots, reverse=True))

    def _check_free(self, slots: list[int], owner: str) -> None:
        seen: set[int] = set()
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.capacity:
                raise ValueError(f"{self.name}.free: slot {s!r} is not in [0, {self.capacity})")
            held = self._owner[s]
            if held is None or s in seen:
                raise SlotError(f"{self.name}: slot {s} freed by {owner!r} but it is already "
                                f"free (double free)")
            if held != owner:
                raise SlotError(f"{self.name}: slot {s} is owned by {held!r}; {owner!r} "
                                f"cannot free it")
            seen.add(s)

    def transfer(self, slots: Iterable[int], owner: str, new_owner: str) -> None:
        """Hand ``slots`` held by ``owner`` over to ``new_owner``, all or none."""
        self._check_open()
        _check_owner(self.name, new_owner)
        slots = list(slots)
        self._check_free(slots, owner)
        for s in slots:
            self._owner[s] = new_owner

    def owner_of(self, slot: int) -> str | None:
        return self._owner[slot]

    def owned_by(self, owner: str) -> list[int]:
        return [s for s, o in enumerate(self._owner) if o == owner]

    def usage(self) -> dict[str, int]:
        """Slots held, by owner; empty when everything is free."""
        return dict(Counter(o for o in self._owner if o is not None))

    def close(self) -> None:
        """Check that every slot is free; ``SlotError`` naming the leaked slots and owners."""
        if self._closed:
            return
        leaked = [(s, o) for s, o in enumerate(self._owner) if o is not None]
        if leaked:
            listed = ", ".join(f"slot {s} (owner {o!r})" for s, o in leaked[:MAX_LISTED])
            more = f" and {len(leaked) - MAX_LISTED} more" if len(leaked) > MAX_LISTED else ""
            raise SlotError(f"{self.name}: {len(leaked)} slots leaked at close: {listed}{more}")
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise SlotError(f"{self.name}: used after close()")


def _check_owner(pool: str, owner: str) -> None:
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"{pool}: owner: expected a non-empty str, got {owner!r}")
