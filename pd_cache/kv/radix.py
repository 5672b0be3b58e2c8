"""A page-granular radix tree over the device (L1) and host (L2) pools.

One node per cached page. Children are keyed by the page's chain name, which hashes the
namespace and the whole prefix, so two namespaces never share a node below the root and
no node stores a namespace; the tokens kept on each node guard against a hash collision.

Device residency is prefix-closed (a node on device has its parent on device), so the
device pages of a match come before its host pages; ``pd_cache.kv.invariants`` lists the
rest and ``check_invariants`` verifies them. A node with ``lock_ref > 0`` is pinned.

Eviction is least-recently-used, leaves first: device pages move to host (or are dropped
when the host has no room), host pages are dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

import torch

from pd_cache.core.config import WRITE_POLICIES
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event
from pd_cache.kv.base import (
    CacheKey,
    HitPage,
    InsertResult,
    MatchResult,
    PrefixCache,
    Tier,
)
from pd_cache.kv.invariants import check_tree
from pd_cache.kv.node import Node, iter_nodes
from pd_cache.kv.pages import check_pages
from pd_cache.kv.pool import PagePool

OWNER = "radix"


class RadixCache(PrefixCache):
    """The prefix cache of one worker; see ``PrefixCache`` for the contract."""

    def __init__(self, device: PagePool, host: PagePool, *,
                 write_policy: str = "write_through", stats: Stats | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"cache.write_policy: expected one of {list(WRITE_POLICIES)}, "
                             f"got {write_policy!r}")
        if device.layout != host.layout:
            raise ValueError(f"layout: device pool {device.layout} != host pool {host.layout}")
        self.device, self.host = device, host
        self.layout = device.layout
        self.page_size = device.layout.page_size
        self.write_policy = write_policy
        self.stats = stats if stats is not None else Stats()
        self.root = Node()
        self._clock = 0
        self._num_locks = 0

    # -- lookup ---------------------------------------------------------------------------

    def match_prefix(self, key: CacheKey, max_pages: int | None = None) -> MatchResult:
        self._check_key(key)
        limit = key.num_pages if max_pages is None else max(0, min(max_pages, key.num_pages))
        node = self.root
        for i in range(limit):
            child = node.children.get(key.names[i])
            if child is None or child.tokens != key.page_tokens(i):
                break
            node = child
        self._touch(node)
        match = self._result(key, node)
        for tier in (Tier.DEVICE, Tier.HOST):
            if match.count(tier):
                self.stats.count(Event.HIT, tier.value, match.count(tier))
        return match

    def load_back(self, match: MatchResult) -> MatchResult:
        self._check_live(match.node)
        missing = [n for n in match.node.path() if n.device_slot is None]
        if missing:
            self.lock(match.node)
            try:
                self._load(missing, self._reserve(self.device, len(missing)))
            finally:
                self.unlock(match.node)
        return self._result(match.key, match.node)

    def read_pages(self, match: MatchResult) -> torch.Tensor:
        # NOTE: slots are read from the tree now, not from ``match``: a load-back or an
        # eviction since the match may have moved pages between tiers.
        pages = self.refresh(match).pages
        on_device = [p.slot for p in pages if p.tier == Tier.DEVICE]
        on_host = [p.slot for p in pages if p.tier == Tier.HOST]
        # NOTE: prefix-closed device residency puts every device page before any host one.
        parts = [self.device.read(on_device), self.host.read(on_host).to(self.device.device)]
        return torch.cat(parts)

    def refresh(self, match: MatchResult) -> MatchResult:
        """``match`` as the tree holds it now (pages may have moved tier); no LRU touch."""
        self._check_live(match.node)
        return self._result(match.key, match.node)

    def _result(self, key: CacheKey, node: Node) -> MatchResult:
        pages = tuple(HitPage(n.name, Tier.DEVICE, n.device_slot, n.seed)
                      if n.device_slot is not None
                      else HitPage(n.name, Tier.HOST, n.host_slot, n.seed) for n in node.path())
        return MatchResult(pages, node, key)

    def prefix_of(self, match: MatchResult, num_pages: int) -> MatchResult:
        if not 0 <= num_pages <= match.num_pages:
            raise ValueError(f"num_pages: expected 0..{match.num_pages}, got {num_pages}")
        node = match.node.path()[num_pages - 1] if num_pages else self.root
        return MatchResult(match.pages[:num_pages], node, match.key)

    # -- insert ---------------------------------------------------------------------------

    def insert(self, key: CacheKey, pages: torch.Tensor, seed: bytes = b"") -> InsertResult:
        self._check_key(key)
        check_pages(pages, self.layout, field="insert: pages")
        if pages.shape[0] < key.num_pages:
            raise ValueError(f"insert: pages: expected at least {key.num_pages} pages, got "
                             f"{pages.shape[0]}")
        node, done = self._walk(key)
        self.lock(node)
        try:
            missing = [n for n in node.path() if n.device_slot is None]
            slots = self._reserve(self.device, len(missing) + key.num_pages - done)
            self._load(missing, slots[:len(missing)])
            if len(slots) < len(missing):
                return InsertResult(node, 0, done)
            new = self._add_pages(node, key, done, pages, slots[len(missing):], seed)
        finally:
            self.unlock(node)
        last = new[-1] if new else node
        self._touch(last)
        return InsertResult(last, len(new), done + len(new))

    def _walk(self, key: CacheKey) -> tuple[Node, int]:
        """The deepest cached node of ``key`` and how many pages it covers."""
        node = self.root
        for i in range(key.num_pages):
            child = node.children.get(key.names[i])
            if child is None or child.tokens != key.page_tokens(i):
                return node, i
            node = child
        return node, key.num_pages

    def _add_pages(self, node: Node, key: CacheKey, start: int, pages: torch.Tensor,
                   slots: list[int], seed: bytes) -> list[Node]:
        """Attach pages ``start, start + 1, ...`` below ``node``, one per device slot."""
        if not slots:
            return []
        end = start + len(slots)
        if key.names[start] in node.children:   # NOTE: a hash collision; keep what is there
            self.device.free(slots, OWNER)
            return []
        self.device.write(slots, pages[start:end])
        host_slots = []
        if self.write_policy == "write_through":
            host_slots = self._reserve(self.host, len(slots))
            self.device.copy_to(self.host, slots[:len(host_slots)], host_slots)
        new = []
        for i, slot in enumerate(slots):
            node = self._attach(node, key, start + i, slot, seed)
            node.host_slot = host_slots[i] if i < len(host_slots) else None
            new.append(node)
        self.stats.count(Event.STORED, Tier.DEVICE.value, len(new))
        if host_slots:
            self.stats.count(Event.STORED, Tier.HOST.value, len(host_slots))
        return new

    def _attach(self, parent: Node, key: CacheKey, i: int, device_slot: int,
                seed: bytes) -> Node:
        child = Node(key.names[i], key.page_tokens(i), parent, seed)
        child.device_slot = device_slot
        parent.children[child.name] = child
        return child

    def _load(self, nodes: list[Node], slots: list[int]) -> None:
        """Copy the first ``len(slots)`` of ``nodes`` from host to those device slots."""
        nodes = nodes[:len(slots)]
        self.host.copy_to(self.device, [n.host_slot for n in nodes], slots)
        for n, s in zip(nodes, slots, strict=True):
            n.device_slot = s

    # -- locks ----------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        self._check_live(node)
        node.own_locks += 1
        self._num_locks += 1
        for n in self._up(node):
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        if not isinstance(node, Node) or node.own_locks <= 0:
            raise ValueError(f"unlock: {node!r} holds no lock")
        node.own_locks -= 1
        self._num_locks -= 1
        for n in self._up(node):
            n.lock_ref -= 1

    @property
    def num_locks(self) -> int:
        return self._num_locks

    # -- eviction -------------------------------------------------------------------------

    def evict(self, tier: Tier, num_pages: int) -> int:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"evict: num_pages: expected an int >= 0, got {num_pages!r}")
        if Tier(tier) == Tier.DEVICE:
            return self._evict(num_pages, self._device_evictable, self._demote)
        if Tier(tier) == Tier.HOST:
            return self._evict(num_pages, self._host_evictable, self._drop_host)
        raise ValueError(f"evict: tier: expected 'device' or 'host', got {tier!r}")

    def clear(self) -> None:
        self.evict(Tier.DEVICE, self.device.capacity)
        self.evict(Tier.HOST, self.host.capacity)

    def _evict(self, n: int, evictable: Callable[[Node], bool],
               release: Callable[[Node], None]) -> int:
        heap = [_entry(x) for x in iter_nodes(self.root) if evictable(x)]
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
                heapq.heappush(heap, _entry(parent))
        return freed

    def _device_evictable(self, node: Node) -> bool:
        return (node.device_slot is not None and node.lock_ref == 0
                and all(c.device_slot is None for c in node.children.values()))

    def _host_evictable(self, node: Node) -> bool:
        return (node.host_slot is not None and node.lock_ref == 0
                and (node.device_slot is not None or not node.children))

    def _demote(self, node: Node) -> None:
        """Device -> host: copy unless already there; drop the subtree if the host is full."""
        if node.host_slot is None:
            slots = self._reserve(self.host, 1)
            if slots:
                self.device.copy_to(self.host, [node.device_slot], slots)
                node.host_slot = slots[0]
                self.stats.count(Event.STORED, Tier.HOST.value)
        self.device.free([node.device_slot], OWNER)
        node.device_slot = None
        self.stats.count(Event.EVICTED, Tier.DEVICE.value)
        if node.host_slot is None:
            self._drop_subtree(node)

    def _drop_host(self, node: Node) -> None:
        self.host.free([node.host_slot], OWNER)
        node.host_slot = None
        self.stats.count(Event.EVICTED, Tier.HOST.value)
        if node.device_slot is None:
            self._drop_subtree(node)

    def _drop_subtree(self, node: Node) -> None:
        """Detach ``node`` and free whatever its (unlocked, host-only) descendants hold."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.device_slot is not None:
                self.device.free([n.device_slot], OWNER)
            if n.host_slot is not None:
                self.host.free([n.host_slot], OWNER)
                self.stats.count(Event.EVICTED, Tier.HOST.value)
            n.device_slot = n.host_slot = None
            n.children = {}
            n.attached = False
        if node.parent is not None:
            del node.parent.children[node.name]

    def _reserve(self, pool: PagePool, n: int) -> list[int]:
        """Up to ``n`` slots of ``pool`` for the tree, evicting unlocked pages to make room."""
        if pool.num_free < n:
            tier = Tier.DEVICE if pool is self.device else Tier.HOST
            self.evict(tier, n - pool.num_free)
        return pool.alloc(min(n, pool.num_free), OWNER)

    # -- bookkeeping ----------------------------------------------------------------------

    def _touch(self, node: Node) -> None:
        self._clock += 1
        for n in self._up(node):
            n.last_access = self._clock

    def _up(self, node: Node) -> Iterator[Node]:
        n: Node | None = node
        while n is not None:
            yield n
            n = n.parent

    def _check_key(self, key: CacheKey) -> None:
        if not isinstance(key, CacheKey) or key.page_size != self.page_size:
            raise ValueError(f"key: expected a CacheKey with page_size={self.page_size}, got "
                             f"{type(key).__name__} with page_size="
                             f"{getattr(key, 'page_size', None)}")

    def _check_live(self, node: Node) -> None:
        if not isinstance(node, Node) or not node.attached:
            raise ValueError("match: its node has been evicted since (stale match result)")

    @property
    def num_device_pages(self) -> int:
        return sum(1 for n in iter_nodes(self.root) if n.device_slot is not None)

    @property
    def num_host_pages(self) -> int:
        return sum(1 for n in iter_nodes(self.root) if n.host_slot is not None)

    def check_invariants(self) -> None:
        check_tree(self.root, self.device, self.host, page_size=self.page_size,
                   num_locks=self._num_locks, owner=OWNER)


def _entry(node: Node) -> tuple[int, int, int, Node]:
    # NOTE: a path is touched at one clock tick; deeper nodes go first among equals.
    return (node.last_access, -node.depth, node.seq, node)
