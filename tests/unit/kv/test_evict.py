"""Eviction from the incremental candidates against a full scan of the tree (the oracle).

The oracle is the eviction the candidates replaced, kept here on its own: every call it
heaps every evictable node of the tree. Two caches take the same random steps and must
agree after each one, node for node, slot for slot, and keep the pool invariants. Steps
include pins with a TTL on one clock the twins share, and the clock moving on: the oracle
sees a pin only through ``evictable`` (a pinned node is not), the candidates park it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pd_cache.core.config import KVLayout
from pd_cache.core.vocab import Tier
from pd_cache.kv import CacheKey, MatchResult, PagePool, RadixCache
from pd_cache.kv.lru import Candidates, scan_evict
from pd_cache.kv.node import Node, iter_nodes

PS = 2
LAYOUT = KVLayout(model_id="t", kv_dtype="float32", num_layers=1, page_size=PS,
                  num_kv_heads=1, head_dim=2)


class ScanCache(RadixCache):
    """``RadixCache`` whose eviction scans the whole tree on every call."""

    def _evict(self, n: int, candidates: Candidates, evictable: Callable[[Node], bool],
               release: Callable[[Node], None]) -> int:
        return scan_evict(self.root, n, evictable, release)


def pools(device: int, host: int) -> tuple[PagePool, PagePool]:
    return PagePool("device", device, LAYOUT), PagePool("host", host, LAYOUT)


def tree(cache: RadixCache) -> list[tuple[object, ...]]:
    """Every node: its path of names, slots, locks, stamp (``seq`` differs by cache) and
    whether it is pinned."""
    return sorted((tuple(p.name for p in n.path()), n.device_slot, n.host_slot, n.lock_ref,
                   n.own_locks, n.last_access, cache.pins.held(n))
                  for n in iter_nodes(cache.root))


class Twins:
    """The same steps on a cache and its oracle; each step's results must be equal."""

    def __init__(self, rng: random.Random, policy: str) -> None:
        device, host = rng.randint(1, 12), rng.randint(0, 12)
        self.rng, self.now = rng, 0.0
        fraction = rng.choice([0.0, 0.5, 1.0])
        self.caches = [cls(*pools(device, host), write_policy=policy,
                           max_pinned_fraction=fraction, clock=lambda: self.now)
                       for cls in (RadixCache, ScanCache)]
        self.locks: list[list[MatchResult]] = []

    def key(self) -> CacheKey:
        tokens = [self.rng.randint(0, 2) for _ in range(self.rng.randint(0, 12))]
        return CacheKey.build(tokens, page_size=PS, cache_salt=self.rng.choice([None, "a"]))

    def step(self) -> str:
        op = self.rng.choice(["insert", "insert", "match", "match", "lock", "unlock",
                              "evict", "evict", "clear", "pin", "tick", "drop_pins"]
                             if self.locks or self.rng.random() < 0.5
                             else ["insert", "match", "lock", "evict", "pin", "tick"])
        if op == "unlock" and self.locks:
            for cache, m in zip(self.caches, self.locks.pop(self.rng.randrange(
                    len(self.locks))), strict=True):
                cache.unlock(m.node)
            return op
        if op == "evict":
            tier, n = self.rng.choice([Tier.DEVICE, Tier.HOST]), self.rng.randint(0, 5)
            self.same(lambda c: c.evict(tier, n))
            return op
        if op == "clear":
            self.same(lambda c: c.clear())
            return op
        if op == "tick":
            self.now += self.rng.choice([0.5, 1.0, 3.0])
            return op
        if op == "drop_pins":
            owner = self.rng.choice([None, "a", "b"])
            self.same(lambda c: c.drop_pins(owner))
            return op
        k = self.key()
        if op == "insert":
            pages = torch.rand(k.num_pages, *LAYOUT.page_shape)
            self.same(lambda c: c.insert(k, pages)[1:])
            return op
        matches = [c.match_prefix(k) for c in self.caches]
        if self.rng.random() < 0.5:
            matches = [c.load_back(m) for c, m in zip(self.caches, matches, strict=True)]
        if op == "lock":
            for c, m in zip(self.caches, matches, strict=True):
                c.lock(m.node)
            self.locks.append(matches)
        if op == "pin":
            ttl, owner = self.rng.choice([1.0, 2.0, 5.0]), self.rng.choice(["a", "b"])
            got = [c.pin(m.node, ttl, owner) for c, m in zip(self.caches, matches, strict=True)]
            assert got[0] == got[1]
        return op

    def same(self, call: Callable[[RadixCache], object]) -> None:
        got, want = (call(c) for c in self.caches)
        assert got == want

    def check(self) -> None:
        cache, oracle = self.caches
        assert tree(cache) == tree(oracle)
        for c in self.caches:
            c.check_invariants()
            assert len(c.pins) <= c.max_pinned_pages
            f, held = c.max_pinned_fraction, [n for n, _ in c.pins.items()]
            on_device = [n for n in held if n in c._device_pins]
            assert len(on_device) <= int(f * c.device.capacity)
            assert len(held) - len(on_device) <= int(f * c.host.capacity)
            assert all(n.attached and (n.device_slot if n in on_device else n.host_slot)
                       is not None for n in held)
        assert sorted(cache.pinned()) == sorted(oracle.pinned())
        # NOTE: stale entries are compacted away: the heaps stay bounded by the pools.
        assert len(cache._on_device) <= 2 * cache.device.capacity + 8
        assert len(cache._on_host) <= 2 * cache.host.capacity + 8

    def finish(self) -> None:
        for matches in self.locks:
            for c, m in zip(self.caches, matches, strict=True):
                c.unlock(m.node)
        self.same(lambda c: c.clear())
        for c in self.caches:
            assert c.num_locks == 0 and c.device.used == 0 and c.host.used == 0
            c.check_invariants()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evictions_match_a_full_scan_step_for_step(policy: str) -> None:
    rng = random.Random(f"evict-{policy}")
    ops: set[str] = set()
    for _ in range(40):
        twins = Twins(rng, policy)
        for _ in range(150):
            ops.add(twins.step())
            twins.check()
        twins.finish()
    assert ops == {"insert", "match", "lock", "unlock", "evict", "clear", "pin", "tick",
                   "drop_pins"}


def test_an_eviction_looks_at_what_it_evicts_not_at_the_whole_tree() -> None:
    cache = RadixCache(*pools(1024, 0))
    for i in range(1000):
        k = CacheKey.build([i, i], page_size=PS)
        cache.insert(k, torch.zeros(1, *LAYOUT.page_shape))
    looked: list[Node] = []
    evictable = cache._device_evictable
    cache._device_evictable = lambda n: looked.append(n) or evictable(n)  # type: ignore[method-assign]
    assert cache.evict(Tier.DEVICE, 3) == 3
    assert len(looked) == 3 and cache.device.used == 997
    first = [CacheKey.build([i, i], page_size=PS).names[0] for i in range(3)]
    assert [n.name for n in looked] == first     # the least recently used, in order
    cache.clear()
    cache.check_invariants()


def test_compaction_drops_stale_entries_and_keeps_every_node_that_holds_a_slot() -> None:
    root, candidates = Node(), Candidates("device_slot", capacity=4)
    nodes = [Node(bytes([i]), (i, i), root) for i in range(4)]
    for i, n in enumerate(nodes):
        n.device_slot, n.last_access, root.children[n.name] = i, i, n
    nodes[3].lock_ref = 1     # a locked node is kept too (its unlock pushes nothing)
    candidates.push(nodes[3])
    for _ in range(10):
        for n in nodes[:3]:
            candidates.push(n)
    assert len(candidates) <= 2 * 4 + 8
    nodes[3].lock_ref = 0
    candidates.unpin(nodes[3])
    popped = []
    while (n := candidates.pop(lambda n: True)) is not None:
        popped.append(n)
        n.device_slot = None  # as an eviction leaves it
    assert popped == nodes
