"""An index shard's change feed: the names it changed, by version, for the fronts' mirrors.

Every change the shard applies (a publisher's batch, a snapshot, a forgotten publisher)
is one version; the log keeps the names each version touched, at most ``bound`` names in
all (the oldest go first). A mirror asks for what changed after the version it holds::

    mirror (epoch e, version v)      shard (epoch E, version V, log from version F)
    changes(e, v)               ->   e == E and F <= v <= V: the names touched after v,
                                     with their masks now (0: gone)
                                     else (a restart, a mirror too far behind): a snapshot

A name touched twice is sent once, with its mask now: the mirror applies the shard's state,
not its history, so applying a delta twice changes nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from pd_cache.core.events import new_epoch
from pd_cache.core.fields import check_int_at_least


class ChangeLog:
    """The names each of a shard's recent versions touched (plain logic, in ``PageIndex``)."""

    def __init__(self, bound: int) -> None:
        check_int_at_least("bound", bound, 1)
        self.bound = bound
        self.epoch = new_epoch()   # a restarted shard's mirrors take a snapshot
        self.version = 0
        self.floor = 0             # the oldest version a delta may start from
        self._log: collections.deque[tuple[int, Sequence[bytes]]] = collections.deque()
        self._size = 0

    def add(self, names: Sequence[bytes]) -> None:
        """One version more: ``names`` changed (their lists are kept, not copied)."""
        if not names:
            return
        self.version += 1
        self._log.append((self.version, names))
        self._size += len(names)
        while self._size > self.bound:
            version, old = self._log.popleft()
            self._size -= len(old)
            self.floor = version

    def since(self, version: int) -> set[bytes] | None:
        """The names changed after ``version``; ``None`` if the log does not reach back
        that far (or ``version`` is not one of this epoch's): a snapshot is needed."""
        if not self.floor <= version <= self.version:
            return None
        out: set[bytes] = set()
        for v, names in reversed(self._log):
            if v <= version:
                break
            out.update(names)
        return out
