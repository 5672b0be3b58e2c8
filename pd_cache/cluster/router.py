"""Routing policy and page provenance: the pure logic behind ``PDCluster``.

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

``ProvenanceLedger`` records which namespace each page name was produced in, and counts
cached pages a request got whose name was produced in another namespace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

Namespace = tuple[str | None, str | None]


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
        self._held: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_workers)]

    def matched(self, worker: int, names: Sequence[bytes]) -> int:
        """Leading pages of ``names`` that ``worker`` is known to hold."""
        held = self._held[worker]
        return next((i for i, name in enumerate(names) if name not in held), len(names))

    def pick(self, names: Sequence[bytes]) -> Route:
        """Longest match first, then least load, then lowest id; overloaded -> least load."""
        routes = [Route(w, self.matched(w, names)) for w in range(len(self.loads))]
        best = min(routes, key=lambda r: (-r.matched_pages, self.loads[r.worker], r.worker))
        idle = min(routes, key=lambda r: (self.loads[r.worker], -r.matched_pages, r.worker))
        if self.loads[best.worker] - self.loads[idle.worker] > self.balance_threshold:
            return idle
        return best

    def least_loaded(self) -> int:
        return min(range(len(self.loads)), key=lambda w: (self.loads[w], w))

    def pack(self, limit: int) -> int:
        """The busiest worker still below ``limit`` requests (its next batch has room),
        else the least loaded: keeps decode batches full instead of spreading them thin."""
        room = [w for w in range(len(self.loads)) if self.loads[w] < limit]
        if not room:
            return self.least_loaded()
        return min(room, key=lambda w: (-self.loads[w], w))

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


class Provenance(NamedTuple):
    """Of a request's cached pages: produced in another namespace / never seen produced."""

    foreign_pages: int
    unattributed_pages: int


class ProvenanceLedger:
    """Page name -> namespaces it was produced in, as workers report them."""

    def __init__(self) -> None:
        self._producers: dict[bytes, set[Namespace]] = {}

    def add(self, namespace: Namespace, names: Sequence[bytes]) -> None:
        for name in names:
            self._producers.setdefault(name, set()).add(namespace)

    def check(self, namespace: Namespace, cached_names: Sequence[bytes]) -> Provenance:
        """``foreign``: a cached name also produced in another namespace (two namespaces
        sharing a name is exactly how a page would leak between them)."""
        foreign = unknown = 0
        for name in cached_names:
            producers = self._producers.get(name)
            if producers is None:
                unknown += 1
            elif producers - {namespace}:
                foreign += 1
        return Provenance(foreign, unknown)

    def shared_names(self) -> int:
        """Names produced in more than one namespace (0 unless names ignore the namespace)."""
        return sum(len(p) > 1 for p in self._producers.values())

    def __len__(self) -> int:
        return len(self._producers)
