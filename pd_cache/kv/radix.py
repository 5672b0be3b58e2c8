"""A page-granular radix tree over the device (L1) and host (L2) pools.

One node per cached page. Children are keyed by the page's chain name, which hashes the
namespace and the whole prefix, so two namespaces never share a node below the root and
no node stores a namespace; the tokens kept on each node guard against a hash collision.

Device residency is prefix-closed (a node on device has its parent on device), so the
device pages of a match come before its host pages; ``pd_cache.kv.invariants`` lists the
rest and ``check_invariants`` verifies them. A node with ``lock_ref > 0`` is locked; a
request may also pin a prefix for a while (``pd_cache.kv.pinning``).

Eviction is least-recently-used, leaves first: device pages move to host (or are dropped
when the host has no room), host pages are dropped (``pd_cache.kv.evict``).

A hybrid model's tree also has a ``StatePool``: a node at a checkpoint page holds the
recurrent state after that page in a state slot, for as long as the node lives. A match is
resumable up to its deepest node with a state (``resume_pages``)::

    match     n0 n1 n2 n3 n4 n5        KV of 6 pages
    state              s3              resume_pages = 4: pages 4, 5 are recomputed from s3
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

import torch

from pd_cache.core.config import WRITE_POLICIES
from pd_cache.core.events import STORED
from pd_cache.core.fields import check_fraction, one_of
from pd_cache.core.pins import Pins
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
from pd_cache.kv.evict import OWNER
from pd_cache.kv.invariants import check_tree
from pd_cache.kv.node import Node, iter_nodes
from pd_cache.kv.pages import check_pages
from pd_cache.kv.pinning import Pinning
from pd_cache.kv.pool import PagePool
from pd_cache.kv.state import StatePool, check_states


class RadixCache(Pinning, PrefixCache):
    """The prefix cache of one worker; see ``PrefixCache`` for the contract.

    ``states`` (a hybrid model's) holds the recurrent states of checkpoint nodes. At most
    ``max_pinned_fraction`` of a pool is pinned; ``clock`` times the pins.
    """

    def __init__(self, device: PagePool, host: PagePool, *,
                 write_policy: str = "write_through", stats: Stats | None = None,
                 states: StatePool | None = None, max_pinned_fraction: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_fraction("cache.max_pinned_fraction", max_pinned_fraction)
        one_of("cache.write_policy", write_policy, WRITE_POLICIES)
        if device.layout != host.layout:
            raise ValueError(f"layout: device pool {device.layout} != host pool {host.layout}")
        if states is not None and states.layout != device.layout:
            raise ValueError(f"layout: state pool {states.layout} != device pool "
                             f"{device.layout}")
        self.device, self.host, self.states = device, host, states
        self.layout = device.layout
        self.page_size = device.layout.page_size
        self.write_policy = write_policy
        self.stats = stats if stats is not None else Stats()
        self.root = Node()
        self._clock = 0
        self._num_locks = 0
        self.max_pinned_fraction, self.pins = max_pinned_fraction, Pins[Node](clock)
        self._init_candidates()

    # -- lookup ---------------------------------------------------------------------------

    def match_prefix(self, key: CacheKey, max_pages: int | None = None) -> MatchResult:
        self._check_key(key)
        limit = key.num_pages if max_pages is None else max(0, min(max_pages, key.num_pages))
        node, _ = self._walk(key, limit)
        self._touch(node)
        match = self._result(key, node)
        for tier in (Tier.DEVICE, Tier.HOST):
            if match.count(tier):
                self.stats.count(Event.HIT, tier.value, match.count(tier))
        return match

    def load_back(self, match: MatchResult, pages: torch.Tensor | None = None) -> MatchResult:
        self._check_live(match.node)
        missing = self._host_only(match.node)
        if pages is not None:
            check_pages(pages, self.layout, field="load_back: pages",
                        num_pages=match.node.depth)
        if missing:
            # NOTE: host-only nodes are a suffix of the path (prefix-closed residency).
            src = None if pages is None else pages[match.node.depth - len(missing):]
            self.lock(match.node)
            try:
                self._load(missing, self._reserve(self.device, len(missing)), src)
            finally:
                self.unlock(match.node)
        return self._result(match.key, match.node)

    def read_pages(self, match: MatchResult, out: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: slots are read from the tree now, not from ``match``: a load-back or an
        # eviction since the match may have moved pages between tiers.
        self._check_live(match.node)
        path = match.node.path()
        on_device = [n.device_slot for n in path if n.device_slot is not None]
        on_host = [n.host_slot for n in path if n.device_slot is None]
        if out is None:
            out = self.device.data.new_empty((len(path), *self.layout.page_shape))
        else:
            check_pages(out, self.layout, field="read_pages: out", num_pages=len(path))
        # NOTE: prefix-closed device residency puts every device page before any host one.
        # Each pool gathers straight into its rows of ``out``: one copy per page.
        d = len(on_device)
        self.device.read(on_device, out=out[:d])
        if on_host and out.device == self.host.device:
            self.host.read(on_host, out=out[d:])
        elif on_host:
            out[d:].copy_(self.host.read(on_host))
        return out

    def refresh(self, match: MatchResult) -> MatchResult:
        """``match`` as the tree holds it now (pages may have moved tier); no LRU touch."""
        self._check_live(match.node)
        return self._result(match.key, match.node)

    def _result(self, key: CacheKey, node: Node) -> MatchResult:
        device, host = Tier.DEVICE, Tier.HOST
        pages = tuple([HitPage(n.name, device, n.device_slot, n.seed)
                       if n.device_slot is not None
                       else HitPage(n.name, host, n.host_slot, n.seed) for n in node.path()])
        return MatchResult(pages, node, key)

    def resume_pages(self, match: MatchResult) -> int:
        # NOTE: without a state pool (a plain model) every page of the match resumes.
        if self.states is None:
            return match.num_pages
        path = match.node.path() if match.num_pages else []
        return next((i + 1 for i in range(len(path) - 1, -1, -1)
                     if path[i].state_slot is not None), 0)

    def read_state(self, match: MatchResult, num_pages: int) -> torch.Tensor:
        node = match.node.path()[num_pages - 1] if 0 < num_pages <= match.num_pages else None
        if node is None or node.state_slot is None or self.states is None:
            raise ValueError(f"read_state: page {num_pages - 1} of the match keeps no state")
        return self.states.read([node.state_slot])[0]

    def prefix_of(self, match: MatchResult, num_pages: int) -> MatchResult:
        if not 0 <= num_pages <= match.num_pages:
            raise ValueError(f"num_pages: expected 0..{match.num_pages}, got {num_pages}")
        node = match.node.path()[num_pages - 1] if num_pages else self.root
        return MatchResult(match.pages[:num_pages], node, match.key)

    # -- insert ---------------------------------------------------------------------------

    def insert(self, key: CacheKey, pages: torch.Tensor, seed: bytes = b"",
               states: Mapping[int, torch.Tensor] | None = None) -> InsertResult:
        # NOTE: a state goes into a slot of the state pool (ignored without a pool).
        self._check_key(key)
        check_pages(pages, self.layout, field="insert: pages")
        for i, one in (states or {}).items() if self.states is not None else ():
            # NOTE: checked before anything changes
            check_states(one[None] if isinstance(one, torch.Tensor) else one, self.layout,
                         field=f"insert: states[{i}]")
        if pages.shape[0] < key.num_pages:
            raise ValueError(f"insert: pages: expected at least {key.num_pages} pages, got "
                             f"{pages.shape[0]}")
        node, done = self._walk(key)
        self.lock(node)
        try:
            missing = self._host_only(node)
            slots = self._reserve(self.device, len(missing) + key.num_pages - done)
            self._load(missing, slots[:len(missing)])
            if len(slots) < len(missing):
                return InsertResult(node, 0, done)
            new = self._add_pages(node, key, done, pages, slots[len(missing):], seed)
        finally:
            self.unlock(node)
        last = new[-1] if new else node
        self._touch(last)
        # NOTE: offered once stamped (an older stamp is only pushed again when popped);
        # nothing evicts between their attach and here.
        for n in new:
            self._offer(n)
        self._keep_states(last, states or {})
        return InsertResult(last, len(new), done + len(new))

    def _keep_states(self, node: Node, states: Mapping[int, torch.Tensor]) -> None:
        """Give the nodes of ``node``'s path at the pages of ``states`` a state slot."""
        if self.states is None or not states:
            return
        path = node.path()
        wanted = sorted(i for i in states if 0 <= i < len(path) and path[i].state_slot is None)
        free = wanted[:self.states.num_free]   # NOTE: sized to never run out (engine)
        if not free:
            return
        slots = self.states.alloc(len(free), OWNER)
        self.states.write(slots, torch.stack([states[i] for i in free]))
        for i, slot in zip(free, slots, strict=True):
            path[i].state_slot = slot

    def _walk(self, key: CacheKey, limit: int | None = None) -> tuple[Node, int]:
        """The deepest cached node of ``key``'s first ``limit`` pages (default: all) and
        how many pages it covers."""
        node, names, tokens, ps = self.root, key.names, key.tokens, self.page_size
        limit = key.num_pages if limit is None else limit
        for i in range(limit):
            child = node.children.get(names[i])
            # NOTE: the page's tokens guard against a name collision (inlined page_tokens:
            # this loop runs once per cached page of every request).
            if child is None or child.tokens != tokens[i * ps:(i + 1) * ps]:
                return node, i
            node = child
        return node, limit

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
        self._log(STORED, Tier.DEVICE, new)
        self._log(STORED, Tier.HOST, new[:len(host_slots)])
        if host_slots:
            self.stats.count(Event.STORED, Tier.HOST.value, len(host_slots))
        return new

    def _attach(self, parent: Node, key: CacheKey, i: int, device_slot: int,
                seed: bytes) -> Node:
        child = Node(key.names[i], key.page_tokens(i), parent, seed)
        child.device_slot = device_slot
        parent.children[child.name] = child
        return child

    def _host_only(self, node: Node) -> list[Node]:
        """The nodes of ``node``'s path that have no device slot, root side first."""
        # NOTE: device residency is prefix-closed: a node on device has its whole path there.
        if node.device_slot is not None:
            return []
        return [n for n in node.path() if n.device_slot is None]

    def _load(self, nodes: list[Node], slots: list[int],
              pages: torch.Tensor | None = None) -> None:
        """Copy the first ``len(slots)`` of ``nodes`` from host (or from ``pages``, a copy
        of theirs in the same order) to those device slots."""
        nodes = nodes[:len(slots)]
        if pages is None:
            self.host.copy_to(self.device, [n.host_slot for n in nodes], slots)
        else:
            self.device.write(slots, pages[:len(slots)])
        for n, s in zip(nodes, slots, strict=True):
            n.device_slot = s
            self._offer(n)
        self._log(STORED, Tier.DEVICE, nodes)

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
            if not n.lock_ref:
                self._unpinned(n)

    @property
    def num_locks(self) -> int:
        return self._num_locks

    # -- bookkeeping ----------------------------------------------------------------------

    def _touch(self, node: Node) -> None:
        self._clock += 1
        for n in self._up(node):
            n.last_access = self._clock
            if self.pins:   # a hit renews the pins of its path
                self.pins.touch(n)

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

    def held(self) -> dict[str, list[bytes]]:
        """Every page's name by the tier holding it (a KV events snapshot)."""
        nodes = list(iter_nodes(self.root))
        return {Tier.DEVICE.value: [n.name for n in nodes if n.device_slot is not None],
                Tier.HOST.value: [n.name for n in nodes if n.host_slot is not None]}

    @property
    def num_device_pages(self) -> int:
        return sum(1 for n in iter_nodes(self.root) if n.device_slot is not None)

    @property
    def num_host_pages(self) -> int:
        return sum(1 for n in iter_nodes(self.root) if n.host_slot is not None)

    @property
    def num_states(self) -> int:
        return sum(1 for n in iter_nodes(self.root) if n.state_slot is not None)

    def check_invariants(self) -> None:
        check_tree(self.root, self.device, self.host, page_size=self.page_size,
                   num_locks=self._num_locks, owner=OWNER, states=self.states)
