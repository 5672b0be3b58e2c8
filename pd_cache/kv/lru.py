"""One tier's eviction candidates, kept up to date without walking the tree.

A heap of ``(last_access, -depth, seq, node)`` entries, lazily invalidated. It holds this
invariant: every node that may be evicted from the tier has an entry whose ``last_access``
is at most the node's own. A touch only raises ``last_access``, so it pushes nothing: an
entry left behind by a touch sorts too early, and when it reaches the top it goes back in
with the node's current stamp. The first entry that reaches the top current and evictable
is therefore the least recently used evictable node, as a scan of the whole tree finds.

A node enters the heap when it may have become evictable: it got a slot of the tier
(``push``), lost a child or a child's device page (``push`` on the parent), or dropped its
last lock while parked. An entry popped for a node that cannot go now leaves the heap: for
good if the node is gone or has no slot of the tier (a new slot pushes again), to the
parked set if the node is locked or pinned (``unpin`` pushes it back: at its last unlock,
or when its pin lapses), and otherwise (it has children that keep it) until one of those
children leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from pd_cache.kv.node import Node, iter_nodes


class Candidates:
    """The nodes that may be evicted from one tier (``slot``: that tier's Node field)."""

    def __init__(self, slot: str, capacity: int,
                 held: Callable[[Node], bool] = lambda node: False) -> None:
        self.slot = slot
        self.held = held   # pinned (``pd_cache.core.pins``): parked like a locked node
        self._heap: list[tuple[int, int, int, Node]] = []
        self._parked: set[Node] = set()   # popped while locked or pinned: pushed back after
        self._limit = 2 * capacity + 8   # past this many entries, drop the stale ones

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Node) -> None:
        """``node`` may have become evictable from this tier (no-op if it holds no slot)."""
        if getattr(node, self.slot) is None:
            return
        # NOTE: a path is touched at one clock tick; deeper nodes go first among equals.
        heapq.heappush(self._heap, (node.last_access, -node.depth, node.seq, node))
        if len(self._heap) > self._limit:
            self._compact()

    def unpin(self, node: Node) -> None:
        """``node``'s last lock was released, or its pin lapsed."""
        if node in self._parked:
            self._parked.discard(node)
            self.push(node)

    def pop(self, evictable: Callable[[Node], bool]) -> Node | None:
        """The least recently used node that ``evictable`` accepts, out of the heap."""
        heap = self._heap
        while heap:
            last, _, _, node = heapq.heappop(heap)
            if not node.attached or getattr(node, self.slot) is None:
                continue
            if last != node.last_access:
                self.push(node)
            elif node.lock_ref or self.held(node):
                self._parked.add(node)
            elif evictable(node):
                return node
        return None

    def _compact(self) -> None:
        """Keep one entry, the latest, per node that still holds a slot of the tier."""
        latest: dict[Node, tuple[int, int, int, Node]] = {}
        for entry in self._heap:
            node = entry[-1]
            if node.attached and getattr(node, self.slot) is not None and (
                    node not in latest or latest[node][0] < entry[0]):
                latest[node] = entry
        self._heap = list(latest.values())
        heapq.heapify(self._heap)

def scan_evict(root: Node, n: int, evictable: Callable[[Node], bool],
               release: Callable[[Node], None]) -> int:
    """The reference eviction, kept apart from ``Candidates``: a heap of every evictable
    node from a walk of the whole tree on every call (what eviction did before the
    candidates). ``tests/unit/kv/test_evict.py`` and ``benchmarks/bench_evict.py`` check
    the candidates against it, step by step; nothing else calls it."""
    def entry(node: Node) -> tuple[int, int, int, Node]:
        return (node.last_access, -node.depth, node.seq, node)

    heap = [entry(x) for x in iter_nodes(root) if evictable(x)]
    heapq.heapify(heap)
    freed = 0
    while freed < n and heap:
        node = heapq.heappop(heap)[-1]
        if not node.attached or not evictable(node):
            continue
        parent = node.parent
        release(node)
        freed += 1
        if parent is not None and not parent.is_root and evictable(parent):
            heapq.heappush(heap, entry(parent))
    return freed
