"""Which stored page goes first when L3 is full: the tail of the least recently used chain.

A hit must be consecutive from a chain's first page, so a page is only worth keeping while
the pages before it are kept. Each stored page hangs from the page before it in its chain
(normally its ``header.prior``, in the same pool) and only a *leaf*, a page nothing stored
hangs from, may be evicted::

    chain A   a0 <- a1 <- a2 <- a3        leaves: a3, b4', c1 (one per branch)
    chain B   b0 <- b1 <- b2 <- b3 <- b4
                           ^--- b3' <- b4'
    chain C   c0 <- c1

Recency: a touch (a store or a hit) stamps the page with a fresh tick. Evicting a leaf
hands its tick to its parent when that becomes a leaf, so a parent counts as touched
whenever a page after it was (touching a page touches its ancestors, without walking
them): the chain touched least recently loses its tail first and, page by page, the rest.
Leaves wait in a heap ordered by tick; an entry that went stale (the page was touched
again, got a child or left) is dropped when it reaches the top.

Quotas (:class:`Shares`): each sealed record carries its tenant's opaque owner label, and
each owner's pages keep an order of their own (one ``TailFirst`` each, on one clock)::

    victim = a tail of an owner over its quota          (it loses its own pages first)
          or the oldest tail among owners without one   (they share the rest, as before)
          or the oldest tail of any owner               (only if quotas exceed the bound)

so an owner within its quota loses no page to another's writes, and a writer over its
quota loses its own tails (:meth:`Shares.excess`), or its new page when nothing else of
it may go.

Pinned records (``pd_cache.storage.pinned``): a victim that ``held`` says is pinned is set
aside, not returned, until ``release`` says its pin lapsed.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable

Slot = tuple[str, bytes]  # (pool, page name)
Owner = bytes | None      # a sealed record's owner label; ``None``: unsealed (no quota)


class EvictionPolicy(ABC):
    """The order in which a store gives up its records (the store owns the bytes).

    ``held(slot)``: whether ``slot`` is pinned now; a held slot is never the victim.
    """

    def __init__(self, held: Callable[[Slot], bool] = lambda slot: False) -> None:
        self.held = held
        self._aside: set[Slot] = set()   # held victims: offered again at ``release``

    def release(self, slot: Slot) -> None:
        """``slot``'s pin lapsed (or was dropped): it may be the victim again."""
        if slot in self._aside:
            self._aside.discard(slot)
            self._offer(slot)

    @abstractmethod
    def _offer(self, slot: Slot) -> None:
        """``slot`` may be a victim (again)."""

    @abstractmethod
    def add(self, slot: Slot, parent: Slot, *, orphan: bool = False) -> None:
        """A record was stored under ``slot``, after the page ``parent`` of its chain.

        ``parent`` need not be stored (a chain's first page hangs from its namespace seed).
        ``orphan``: the parent was just evicted, so this page cannot serve a hit: it goes
        before every page that can.
        """

    @abstractmethod
    def touch(self, slot: Slot) -> None:
        """``slot`` (stored) was just used: it becomes the most recent."""

    @abstractmethod
    def remove(self, slot: Slot) -> None:
        """``slot`` is no longer stored (evicted or deleted); unknown slots are ignored."""

    @abstractmethod
    def victim(self) -> Slot | None:
        """The slot to evict next, without removing it; ``None`` when nothing is stored."""

    def rank(self, slot: Slot) -> int:
        """``slot``'s place in the order (lower goes first); comparable between policies
        that share a clock."""
        return 0


class TailFirst(EvictionPolicy):
    """Least recently used chain first, each chain from its last stored page back.

    ``add``, ``touch`` and ``remove`` cost O(log n), ``victim`` O(log n) amortized.
    """

    def __init__(self, held: Callable[[Slot], bool] = lambda slot: False, *,
                 clock: Callable[[], int] | None = None) -> None:
        super().__init__(held)
        self._clock = clock or itertools.count(1).__next__
        self._ticks: dict[Slot, int] = {}
        self._parent: dict[Slot, Slot] = {}
        self._children: Counter[Slot] = Counter()  # stored pages hanging from a slot
        self._leaves: list[tuple[int, Slot]] = []  # heap; may hold stale entries

    def add(self, slot: Slot, parent: Slot, *, orphan: bool = False) -> None:
        self.remove(slot)
        self._parent[slot] = parent
        self._children[parent] += 1
        # NOTE: ticks below zero sort before every page that can still serve a hit.
        self._ticks[slot] = -self._tick() if orphan else self._tick()
        self._offer(slot)

    def touch(self, slot: Slot) -> None:
        if slot in self._ticks:
            self._ticks[slot] = self._tick()
            self._offer(slot)

    def remove(self, slot: Slot) -> None:
        self._aside.discard(slot)
        tick = self._ticks.pop(slot, None)
        if tick is None:
            return
        parent = self._parent.pop(slot)
        self._children[parent] -= 1
        if self._children[parent] <= 0:
            del self._children[parent]
            if parent in self._ticks:  # the parent is a leaf again, as recent as its child
                self._ticks[parent] = max(self._ticks[parent], tick)
                self._offer(parent)

    def victim(self) -> Slot | None:
        while self._leaves:
            tick, slot = self._leaves[0]
            if self._ticks.get(slot) == tick and slot not in self._children:
                if not self.held(slot):
                    return slot
                self._aside.add(slot)
            heapq.heappop(self._leaves)
        return None

    def rank(self, slot: Slot) -> int:
        return self._ticks[slot]

    def _tick(self) -> int:
        return self._clock()

    def _offer(self, slot: Slot) -> None:
        if slot not in self._ticks or slot in self._children:
            return  # not a leaf: it is offered again once its last child goes
        heapq.heappush(self._leaves, (self._ticks[slot], slot))
        if len(self._leaves) > 2 * len(self._ticks) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (each touch of a leaf leaves one behind)."""
        self._leaves = [(t, s) for s, t in self._ticks.items() if s not in self._children]
        heapq.heapify(self._leaves)


class Shares(EvictionPolicy):
    """Tails first per owner label, within each owner's quota (see the module docstring).

    ``owned``: bytes stored per owner; ``quotas``: bytes per owner label (absent: none);
    ``held``: as :class:`EvictionPolicy`'s, for every owner's pages.
    """

    def __init__(self, held: Callable[[Slot], bool] = lambda slot: False) -> None:
        super().__init__(held)
        self._clock = itertools.count(1).__next__
        self._policies: dict[Owner, TailFirst] = {}
        self._slots: dict[Slot, tuple[Owner, int]] = {}
        self.owned: Counter[Owner] = Counter()
        self.quotas: dict[bytes, int] = {}

    def add(self, slot: Slot, parent: Slot, *, orphan: bool = False, owner: Owner = None,
            nbytes: int = 0) -> None:
        """As :meth:`EvictionPolicy.add`, for a record of ``nbytes`` sealed by ``owner``."""
        self.remove(slot)
        policy = self._policies.get(owner)
        if policy is None:
            policy = self._policies[owner] = TailFirst(self.held, clock=self._clock)
        policy.add(slot, parent, orphan=orphan)
        self._slots[slot] = (owner, nbytes)
        self.owned[owner] += nbytes

    def touch(self, slot: Slot) -> None:
        if slot in self._slots:
            self._policies[self._slots[slot][0]].touch(slot)

    def remove(self, slot: Slot) -> None:
        owner, nbytes = self._slots.pop(slot, (None, -1))
        if nbytes >= 0:
            self._policies[owner].remove(slot)
            self.owned[owner] -= nbytes

    def victim(self) -> Slot | None:
        return self.excess() or self._oldest(o for o in self._policies
                                             if self.quota(o) is None) \
            or self._oldest(self._policies)

    def rank(self, slot: Slot) -> int:
        return self._policies[self._slots[slot][0]].rank(slot)

    def release(self, slot: Slot) -> None:
        self._offer(slot)

    def _offer(self, slot: Slot) -> None:
        if slot in self._slots:
            self._policies[self._slots[slot][0]].release(slot)

    def owner(self, slot: Slot) -> Owner:
        return self._slots[slot][0]

    def quota(self, owner: Owner) -> int | None:
        return None if owner is None else self.quotas.get(owner)

    def over(self, owner: Owner) -> bool:
        """Whether ``owner`` holds more than its quota."""
        quota = self.quota(owner)
        return quota is not None and self.owned[owner] > quota

    def excess(self, owner: Owner = None) -> Slot | None:
        """The next tail of ``owner`` (``None``: of any owner) over its quota, if any
        (unsealed records have no quota)."""
        for o in self._policies if owner is None else (owner,):
            if self.over(o) and (slot := self._policies[o].victim()) is not None:
                return slot
        return None

    def _oldest(self, owners: Iterable[Owner]) -> Slot | None:
        """The victim ranked first among ``owners``' own ones."""
        tails = [(p.rank(s), s) for p in map(self._policies.__getitem__, owners)
                 if (s := p.victim()) is not None]
        return min(tails)[1] if tails else None
