"""Routing policy: the pure logic behind ``PDCluster``.

``PrefixRouter`` picks a prefill worker by the longest prefix of the request's page names
that the worker is known to hold, balanced by load: if the best match is busier than the
least loaded worker by more than ``balance_threshold`` requests, the least loaded wins::

    names   n0 n1 n2 n3          worker 0 holds n0 n1 n2   match 3, in flight 4
                                 worker 1 holds n0          match 1, in flight 0
    threshold 2: 4 - 0 > 2  ->  worker 1 (else worker 0)

Page names already carry the namespace (the chain starts at the namespace seed), so a
match never crosses namespaces. The index is what the router saw each worker compute or
load, bounded by the worker's L1 + L2 capacity, least recently used first out: a hint, not
the truth (a worker may have evicted a page since).

A worker whose call failed because its process died is ``down``: no request goes to it
until it answers again (``mark_up``); with every worker down, ``NoLiveWorker``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

Namespace = tuple[str | None, str | None]


class NoLiveWorker(RuntimeError):
    """Every worker of a role is down (restarting or dead)."""


class Route(NamedTuple):
    worker: int
    matched_pages: int


class PrefixRouter:
    """Which worker gets the next request; loads are requests in flight per worker."""

    def __init__(self, num_workers: int, capacity_pages: int, balance_threshold: int = 2) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers: expected an int >= 1, got {num_workers!r}")
        if not isinstance(balance_threshold, int) or balance_threshold < 0:
            raise ValueError(f"balance_threshold: expected an int >= 0, got "
                             f"{balance_threshold!r}")
        self.capacity = max(0, int(capacity_pages))
        self.balance_threshold = balance_threshold
        self.loads = [0] * num_workers
        self.down: set[int] = set()
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_workers)]

    def matched(self, worker: int, names: Sequence[bytes]) -> int:
        """Leading pages of ``names`` that ``worker`` is known to hold."""
        held = self._held[worker]
        return next((i for i, name in enumerate(names) if name not in held), len(names))

    def live(self, exclude: Sequence[int] = ()) -> list[int]:
        """Workers not down and not in ``exclude``; ``NoLiveWorker`` if there are none."""
        out = [w for w in range(len(self.loads)) if w not in self.down and w not in exclude]
        if not out:
            raise NoLiveWorker(f"no live worker (down: {sorted(self.down)}, "
                               f"excluded: {sorted(exclude)})")
        return out

    def pick(self, names: Sequence[bytes], exclude: Sequence[int] = (),
             known: Sequence[int] = ()) -> Route:
        """Longest match first, then least load, then lowest id; overloaded -> least load.
        ``known``: per worker, the leading pages it holds as another source says (a page
        index), where more than this router knows."""
        routes = [Route(w, max(self.matched(w, names), known[w] if known else 0))
                  for w in self.live(exclude)]
        best = min(routes, key=lambda r: (-r.matched_pages, self.loads[r.worker], r.worker))
        idle = min(routes, key=lambda r: (self.loads[r.worker], -r.matched_pages, r.worker))
        if self.loads[best.worker] - self.loads[idle.worker] > self.balance_threshold:
            return idle
        return best

    def least_loaded(self, exclude: Sequence[int] = ()) -> int:
        return min(self.live(exclude), key=lambda w: (self.loads[w], w))

    def pack(self, limit: int, exclude: Sequence[int] = ()) -> int:
        """The busiest worker still below ``limit`` requests (its next batch has room),
        else the least loaded: keeps decode batches full instead of spreading them thin."""
        live = self.live(exclude)
        room = [w for w in live if self.loads[w] < limit]
        if not room:
            return self.least_loaded(exclude)
        return min(room, key=lambda w: (-self.loads[w], w))

    def mark_down(self, worker: int) -> None:
        """``worker`` died: route around it; what the router knew it held is forgotten (a
        restarted process starts empty)."""
        self.down.add(worker)
        self._held[worker].clear()

    def forget(self) -> None:
        """Every worker's cache was emptied: no page is known to be held anywhere."""
        for held in self._held:
            held.clear()

    def mark_up(self, worker: int) -> None:
        self.down.discard(worker)

    def begin(self, worker: int) -> None:
        self.loads[worker] += 1

    def end(self, worker: int) -> None:
        self.loads[worker] -= 1

    def record(self, worker: int, names: Sequence[bytes]) -> None:
        """``worker`` now holds ``names`` (most recently used)."""
        held = self._held[worker]
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.capacity:
            held.popitem(last=False)
