"""Eviction of the radix tree's pages: least recently used, leaves first.

Device pages move to host (copied unless already there) or, when the host has no room,
are dropped with their subtree; host pages are dropped. A dropped node gives back every
slot it held, its recurrent state's included. Locked nodes are never touched. A pinned page
is held in one tier until its pin lapses (``pd_cache.kv.pinning``): its host copy, or, for
the pages a pin holds on device, its device copy; its copy in the other tier goes as any.

The candidates of each tier are kept as the tree changes (``pd_cache.kv.lru``), so an
eviction costs what it evicts, not a walk of the tree. Whatever sets a slot of a node calls
``_offer(node)``; whatever unlocks a node calls ``_unpinned`` for each node left unlocked.
"""

from __future__ import annotations

from collections.abc import Callable

from pd_cache.core.events import REMOVED, STORED, EventLog
from pd_cache.core.pins import Pins
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, Tier
from pd_cache.kv.lru import Candidates
from pd_cache.kv.node import Node, iter_nodes
from pd_cache.kv.pool import PagePool
from pd_cache.kv.state import StatePool

OWNER = "radix"


class Evicting:
    """What ``RadixCache`` evicts with: its pools, tree and counts."""

    device: PagePool
    host: PagePool
    states: StatePool | None
    stats: Stats
    root: Node
    journal: EventLog | None = None   # KV events of the pages entering and leaving each tier

    def _log(self, stored: bool, tier: Tier, nodes: list[Node]) -> None:
        if self.journal is not None and nodes:
            self.journal.add(stored, tier.value, [n.name for n in nodes])
    pins: Pins[Node]

    def _init_candidates(self) -> None:
        self._device_pins: set[Node] = set()   # pinned pages held on device; others on host
        self._on_device = Candidates("device_slot", self.device.capacity,
                                     self._held_on_device)
        self._on_host = Candidates("host_slot", self.host.capacity, self._held_on_host)

    def _held_on_device(self, node: Node) -> bool:
        return node in self._device_pins and self.pins.held(node)

    def _held_on_host(self, node: Node) -> bool:
        return node not in self._device_pins and self.pins.held(node)

    def evict(self, tier: Tier, num_pages: int) -> int:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"evict: num_pages: expected an int >= 0, got {num_pages!r}")
        if Tier(tier) == Tier.DEVICE:
            return self._evict(num_pages, self._on_device, self._device_evictable,
                               self._demote)
        if Tier(tier) == Tier.HOST:
            return self._evict(num_pages, self._on_host, self._host_evictable,
                               self._drop_host)
        raise ValueError(f"evict: tier: expected 'device' or 'host', got {tier!r}")

    def clear(self) -> None:
        self.evict(Tier.DEVICE, self.device.capacity)
        self.evict(Tier.HOST, self.host.capacity)

    def drop_where(self, doomed: Callable[[Node], bool]) -> int:
        """Drop from both tiers every unlocked page ``doomed`` names, with the pages after
        it (a purged tenant's); pages a request holds stay. How many pages went."""
        dropped = 0
        for node in list(iter_nodes(self.root)):   # parents first: a dropped one's
            if node.attached and node.lock_ref == 0 and doomed(node):   # children go with it
                dropped += sum(1 for _ in iter_nodes(node)) + 1
                self._drop_subtree(node)
        return dropped

    def _evict(self, n: int, candidates: Candidates, evictable: Callable[[Node], bool],
               release: Callable[[Node], None]) -> int:
        self._lapse()
        freed = 0
        while freed < n:
            node = candidates.pop(evictable)
            if node is None:
                break
            release(node)
            freed += 1
        return freed

    def _offer(self, node: Node) -> None:
        """``node`` got a slot, or lost a child or a child's device page."""
        if not node.is_root:
            self._on_device.push(node)
            self._on_host.push(node)

    def _unpinned(self, node: Node) -> None:
        self._on_device.unpin(node)
        self._on_host.unpin(node)

    def _lapse(self) -> None:
        """Give the nodes whose pins lapsed back to eviction."""
        for node in self.pins.expired():
            self._device_pins.discard(node)
            self._unpinned(node)

    def _device_evictable(self, node: Node) -> bool:
        return (node.device_slot is not None and node.lock_ref == 0
                and all(c.device_slot is None for c in node.children.values())
                and not self._held_on_device(node))

    def _host_evictable(self, node: Node) -> bool:
        return (node.host_slot is not None and node.lock_ref == 0
                and (node.device_slot is not None or not node.children)
                and not self._held_on_host(node))

    def _copy_to_host(self, node: Node) -> bool:
        """Give ``node`` (on device) a host copy unless it has one; whether it has one now
        (``False``: the host has no room, even after evicting)."""
        if node.host_slot is None:
            slots = self._reserve(self.host, 1)
            if not slots:
                return False
            self.device.copy_to(self.host, [node.device_slot], slots)
            node.host_slot = slots[0]
            self._log(STORED, Tier.HOST, [node])
            self._on_host.push(node)
            self.stats.count(Event.STORED, Tier.HOST.value)
        return True

    def _demote(self, node: Node) -> None:
        """Device -> host: copy unless already there; drop the subtree if the host is full."""
        self._copy_to_host(node)
        self.device.free([node.device_slot], OWNER)
        node.device_slot = None
        self._log(REMOVED, Tier.DEVICE, [node])
        self.stats.count(Event.EVICTED, Tier.DEVICE.value)
        if node.host_slot is None:
            self._drop_subtree(node)
        elif node.parent is not None:   # its last device child may have been this one
            self._on_device.push(node.parent)

    def _drop_host(self, node: Node) -> None:
        self.host.free([node.host_slot], OWNER)
        node.host_slot = None
        self._log(REMOVED, Tier.HOST, [node])
        self.stats.count(Event.EVICTED, Tier.HOST.value)
        if node.device_slot is None:
            self._drop_subtree(node)

    def _drop_subtree(self, node: Node) -> None:
        """Detach ``node`` and free whatever its (unlocked, host-only) descendants hold."""
        stack, on = [node], {Tier.DEVICE: [], Tier.HOST: []}
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.device_slot is not None:
                on[Tier.DEVICE].append(n)
                self.device.free([n.device_slot], OWNER)
            if n.host_slot is not None:
                on[Tier.HOST].append(n)
                self.host.free([n.host_slot], OWNER)
                self.stats.count(Event.EVICTED, Tier.HOST.value)
            if n.state_slot is not None:
                self.states.free([n.state_slot], OWNER)
            n.device_slot = n.host_slot = n.state_slot = None
            self.pins.drop(n)
            self._device_pins.discard(n)
            n.children = {}
            n.attached = False
        for tier, nodes in on.items():
            self._log(REMOVED, tier, nodes)
        if node.parent is not None:
            del node.parent.children[node.name]
            self._offer(node.parent)

    def _reserve(self, pool: PagePool, n: int) -> list[int]:
        """Up to ``n`` slots of ``pool`` for the tree, evicting unlocked pages to make room."""
        if pool.num_free < n:
            tier = Tier.DEVICE if pool is self.device else Tier.HOST
            self.evict(tier, n - pool.num_free)
        return pool.alloc(min(n, pool.num_free), OWNER)
