"""Radix prefix cache over real page pools: tiers, write policies, locks, LRU, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pd_cache.core.config import WRITE_POLICIES, KVLayout
from pd_cache.core.events import EventLog
from pd_cache.core.vocab import Event, Tier
from pd_cache.kv import OWNER, CacheInvariantError, CacheKey, MatchResult, PagePool, RadixCache

PS = 2
LAYOUT = KVLayout(model_id="t", kv_dtype="float32", num_layers=1, page_size=PS,
                  num_kv_heads=1, head_dim=2)


def make_cache(device: int = 8, host: int = 8, policy: str = "write_through") -> RadixCache:
    return RadixCache(PagePool("device", device, LAYOUT), PagePool("host", host, LAYOUT),
                      write_policy=policy)


def key(tokens: list[int], ns: str | None = None, extra_key: str | None = None) -> CacheKey:
    return CacheKey.build(tokens, page_size=PS, cache_salt=ns, extra_key=extra_key)


def page_data(k: CacheKey) -> torch.Tensor:
    """Distinct contents per (namespace, prefix): derived from each page's chain name."""
    base = torch.arange(LAYOUT.page_shape[0] * 4, dtype=torch.float32).view(LAYOUT.page_shape)
    return torch.stack([base + int.from_bytes(n[:3], "little") for n in k.names]) \
        if k.names else torch.empty(0, *LAYOUT.page_shape)


def tiers(m: MatchResult) -> list[str]:
    return [p.tier.value for p in m.pages]


def drain(cache: RadixCache) -> None:
    cache.clear()
    assert cache.device.used == 0 and cache.host.used == 0
    cache.device.close()
    cache.host.close()


def test_match_returns_the_longest_cached_prefix_by_page() -> None:
    cache = make_cache()
    k = key([1, 2, 3, 4, 5, 6, 7, 8, 9])           # 4 full pages; token 9 is never cached
    assert cache.match_prefix(k).num_pages == 0
    assert cache.match_prefix(k).node is cache.root
    r = cache.insert(k, page_data(k))
    assert (r.num_new, r.num_pages) == (4, 4)
    m = cache.match_prefix(k)
    assert tiers(m) == ["device"] * 4 and m.num_tokens == 8 and m.node is r.node
    assert [p.name for p in m.pages] == list(k.names)
    assert torch.equal(cache.read_pages(m), page_data(k))
    assert cache.match_prefix(key([1, 2, 3, 4, 5])).num_pages == 2
    assert cache.match_prefix(key([1, 2, 3, 4, 0, 0, 7, 8])).num_pages == 2
    assert cache.match_prefix(k, max_pages=3).num_pages == 3
    assert cache.match_prefix(k).names_past_hit == ()
    assert cache.insert(k, page_data(k)).num_new == 0      # already cached
    cache.check_invariants()
    drain(cache)


def test_namespaces_never_share_pages() -> None:
    cache = make_cache()
    tokens = [1, 2, 3, 4, 5, 6]
    k = key(tokens, ns="tenant-a")
    cache.insert(k, page_data(k))
    assert cache.match_prefix(key(tokens, ns="tenant-a")).num_pages == 3
    assert cache.match_prefix(key(tokens)).num_pages == 0
    assert cache.match_prefix(key(tokens, ns="tenant-b")).num_pages == 0
    assert cache.match_prefix(key(tokens, extra_key="tenant-a")).num_pages == 0
    drain(cache)


def test_a_name_with_other_tokens_is_not_a_hit() -> None:
    cache = make_cache()
    k = key([1, 2, 3, 4])
    cache.insert(k, page_data(k))
    forged = CacheKey(k.namespace, (1, 2, 9, 9), k.names, PS)   # as if the hash collided
    assert cache.match_prefix(forged).num_pages == 1
    assert cache.insert(forged, page_data(k)).num_pages == 1
    cache.check_invariants()
    drain(cache)


def test_write_through_copies_at_insert_and_loads_back_on_a_host_hit() -> None:
    cache = make_cache(policy="write_through")
    k = key(list(range(8)))
    cache.insert(k, page_data(k))
    assert cache.num_host_pages == 4 and cache.host.used == 4
    assert cache.evict(Tier.DEVICE, 4) == 4
    m = cache.match_prefix(k)
    assert tiers(m) == ["host"] * 4 and cache.device.used == 0
    assert torch.equal(cache.read_pages(m), page_data(k))
    loaded = cache.load_back(m)
    assert tiers(loaded) == ["device"] * 4 and cache.num_host_pages == 4
    assert torch.equal(cache.device.read([p.slot for p in loaded.pages]), page_data(k))
    assert cache.stats.get(Event.HIT, "host") == 4
    cache.check_invariants()
    drain(cache)


def test_write_back_copies_only_at_device_eviction() -> None:
    cache = make_cache(policy="write_back")
    k = key(list(range(8)))
    cache.insert(k, page_data(k))
    assert cache.host.used == 0
    assert cache.evict(Tier.DEVICE, 3) == 3                 # leaves first: pages 1..3
    m = cache.match_prefix(k)
    assert tiers(m) == ["device", "host", "host", "host"] and cache.host.used == 3
    assert torch.equal(cache.read_pages(m), page_data(k))
    cache.check_invariants()
    drain(cache)


def test_read_pages_into_out_gathers_both_tiers_in_key_order() -> None:
    cache = make_cache(policy="write_back")
    k = key(list(range(8)))
    cache.insert(k, page_data(k))
    cache.evict(Tier.DEVICE, 2)                             # pages 2, 3 go to host
    m = cache.match_prefix(k)
    assert tiers(m) == ["device", "device", "host", "host"]
    buf = torch.full((6, *LAYOUT.page_shape), -1.0)
    got = cache.read_pages(m, out=buf[1:5])
    assert got.data_ptr() == buf[1:5].data_ptr()            # filled in place, no temporary
    assert torch.equal(buf[1:5], page_data(k))
    assert bool((buf[0] == -1).all()) and bool((buf[5] == -1).all())
    buf.zero_()                                             # a copy: the pools are unchanged
    assert torch.equal(cache.read_pages(m), page_data(k))
    with pytest.raises(ValueError, match="read_pages: out: expected 4 pages, got 3"):
        cache.read_pages(m, out=buf[:3])
    with pytest.raises(ValueError, match="read_pages: out: expected dtype torch.float32"):
        cache.read_pages(m, out=buf[:4].to(torch.bfloat16))
    cache.check_invariants()
    drain(cache)


def test_load_back_from_pages_already_read() -> None:
    cache = make_cache(policy="write_back")
    k = key(list(range(8)))
    cache.insert(k, page_data(k))
    cache.evict(Tier.DEVICE, 3)                             # pages 1..3 go to host
    m = cache.match_prefix(k)
    read = cache.read_pages(m)
    with pytest.raises(ValueError, match="load_back: pages: expected 4 pages, got 3"):
        cache.load_back(m, read[:3])
    loaded = cache.load_back(m, read)
    assert tiers(loaded) == ["device"] * 4
    assert torch.equal(cache.device.read([p.slot for p in loaded.pages]), page_data(k))
    cache.check_invariants()
    drain(cache)


def test_device_eviction_drops_pages_when_the_host_has_no_room() -> None:
    cache = make_cache(host=0, policy="write_back")
    k = key(list(range(8)))
    cache.insert(k, page_data(k))
    assert cache.evict(Tier.DEVICE, 2) == 2
    assert tiers(cache.match_prefix(k)) == ["device", "device"]
    assert cache.stats.get(Event.EVICTED, "device") == 2
    drain(cache)


def test_host_eviction_drops_host_only_leaves_and_keeps_device_pages() -> None:
    cache = make_cache(policy="write_through")
    k = key(list(range(8)))
    cache.insert(k, page_data(k))
    cache.evict(Tier.DEVICE, 2)                               # pages 2, 3 host-only now
    assert cache.evict(Tier.HOST, 3) == 3
    m = cache.match_prefix(k)
    assert tiers(m) == ["device", "device"]                   # 3 dropped, then 2, then 1's copy
    assert cache.host.used == 1
    cache.check_invariants()
    drain(cache)


def test_least_recently_used_goes_first() -> None:
    cache = make_cache(device=4, host=0)
    a, b = key([1, 1, 1, 1]), key([2, 2, 2, 2])
    cache.insert(a, page_data(a))
    cache.insert(b, page_data(b))
    cache.match_prefix(a)                                     # a is now the most recent
    c = key([3, 3, 3, 3])
    assert cache.insert(c, page_data(c)).num_pages == 2       # needs b's two slots
    assert cache.match_prefix(b).num_pages == 0
    assert cache.match_prefix(a).num_pages == 2
    drain(cache)


def test_locked_pages_are_never_evicted() -> None:
    cache = make_cache(device=4, host=0)
    a = key([1, 1, 1, 1])
    deep = cache.insert(a, page_data(a)).node
    cache.lock(deep)
    assert cache.evict(Tier.DEVICE, 4) == 0                   # the lock pins the ancestors too
    b = key([2, 2, 2, 2])
    assert cache.insert(b, page_data(b)).num_pages == 2       # the two free slots
    c = key([3, 3])
    assert cache.insert(c, page_data(c)).num_pages == 1       # evicts from b, never a
    assert cache.match_prefix(a).num_pages == 2
    assert cache.num_locks == 1
    cache.unlock(deep)
    with pytest.raises(ValueError, match="holds no lock"):
        cache.unlock(deep)
    assert cache.evict(Tier.DEVICE, 4) == 4
    drain(cache)


def test_insert_stops_without_error_when_every_slot_is_locked() -> None:
    cache = make_cache(device=2, host=2)
    a = key([1, 1, 1, 1])
    cache.lock(cache.insert(a, page_data(a)).node)
    b = key([2, 2])
    r = cache.insert(b, page_data(b))
    assert (r.num_new, r.num_pages) == (0, 0) and r.node is cache.root
    assert cache.match_prefix(b).num_pages == 0
    cache.unlock(cache.match_prefix(a).node)
    drain(cache)


def test_insert_below_a_host_only_prefix_loads_it_back() -> None:
    cache = make_cache(policy="write_back")
    short, longer = key([5, 5, 6, 6]), key([5, 5, 6, 6, 7, 7])
    cache.insert(short, page_data(short))
    cache.evict(Tier.DEVICE, 2)
    assert tiers(cache.match_prefix(short)) == ["host", "host"]
    r = cache.insert(longer, page_data(longer))
    assert (r.num_new, r.num_pages) == (1, 3)
    m = cache.match_prefix(longer)
    assert tiers(m) == ["device"] * 3
    assert torch.equal(cache.read_pages(m), page_data(longer))
    cache.check_invariants()
    drain(cache)


def test_load_back_is_partial_when_the_device_is_short() -> None:
    cache = make_cache(device=2, host=4)
    k = key(list(range(8)))
    assert cache.insert(k, page_data(k)).num_pages == 2
    cache.evict(Tier.DEVICE, 2)
    loaded = cache.load_back(cache.match_prefix(k))
    assert tiers(loaded) == ["device", "device"]
    drain(cache)


def test_a_stale_match_is_refused() -> None:
    cache = make_cache(host=0)
    k = key([1, 2, 3, 4])
    cache.insert(k, page_data(k))
    m = cache.match_prefix(k)
    cache.evict(Tier.DEVICE, 2)
    with pytest.raises(ValueError, match="stale match"):
        cache.load_back(m)
    with pytest.raises(ValueError, match="stale match"):
        cache.read_pages(m)
    with pytest.raises(ValueError, match="stale match"):
        cache.lock(m.node)
    drain(cache)


def test_bad_arguments_are_value_errors() -> None:
    cache = make_cache()
    k = key([1, 2, 3, 4])
    with pytest.raises(ValueError, match="insert: pages: expected at least 2 pages, got 1"):
        cache.insert(k, page_data(k)[:1])
    with pytest.raises(ValueError, match="insert: pages: expected dtype torch.float32"):
        cache.insert(k, page_data(k).half())
    with pytest.raises(ValueError, match="key: expected a CacheKey with page_size=2"):
        cache.match_prefix(CacheKey.build([1, 2, 3, 4], page_size=4))
    with pytest.raises(ValueError, match="num_pages: expected an int >= 0"):
        cache.evict(Tier.DEVICE, -1)
    with pytest.raises(ValueError, match="tier: expected 'device' or 'host'"):
        cache.evict(Tier.STORAGE, 1)
    with pytest.raises(ValueError, match="cache.write_policy"):
        make_cache(policy="write_around")
    drain(cache)


def test_check_invariants_catches_a_slot_freed_behind_the_trees_back() -> None:
    cache = make_cache()
    k = key([1, 2, 3, 4])
    cache.insert(k, page_data(k))
    slot = cache.match_prefix(k).pages[0].slot
    cache.device.allocator.transfer([slot], OWNER, "someone-else")
    with pytest.raises(CacheInvariantError, match="device: pool slots owned by 'radix'"):
        cache.check_invariants()


NAMESPACES = st.sampled_from([None, "a", "b"])
TOKENS = st.lists(st.integers(0, 1), max_size=8)


class RadixMachine(RuleBasedStateMachine):
    """Random insert / match / load-back / lock / unlock / evict against a simple model.

    The model is the set of page-aligned ``(namespace, prefix)`` ever inserted, plus the
    locks held. Whatever the cache evicts, a hit must be a prefix inserted in the same
    namespace with that prefix's own data; a lock keeps its pages in their tier or a
    faster one; and tree, pools and lock counts agree after every step. Its KV events,
    replayed in order, give what each tier holds after every step.
    """

    @initialize(policy=st.sampled_from(WRITE_POLICIES), device=st.integers(0, 6),
                host=st.integers(0, 6))
    def setup(self, policy: str, device: int, host: int) -> None:
        self.cache = make_cache(device, host, policy)
        self.inserted: set[tuple[str | None, tuple[int, ...]]] = set()
        self.locks: list[tuple[MatchResult, list[bool]]] = []
        self.cache.journal = EventLog()
        self.replayed: dict[str, set[bytes]] = {"device": set(), "host": set()}

    keys = Bundle("keys")

    @rule(target=keys, ns=NAMESPACES, tokens=TOKENS)
    def insert(self, ns: str | None, tokens: list[int]) -> tuple[str | None, list[int]]:
        k = key(tokens, ns)
        r = self.cache.insert(k, page_data(k))
        assert 0 <= r.num_pages <= k.num_pages
        self.inserted.update((ns, tuple(tokens[:(i + 1) * PS])) for i in range(r.num_pages))
        assert self.cache.match_prefix(k).num_pages == r.num_pages
        return ns, tokens

    @rule(known=keys, cut=st.integers(0, 9), tail=TOKENS, load=st.booleans(),
          lock=st.booleans())
    def match_inserted(self, known: tuple[str | None, list[int]], cut: int, tail: list[int],
                       load: bool, lock: bool) -> None:
        """Look up a prefix of an inserted key, maybe followed by other tokens."""
        ns, tokens = known
        self.match(ns, tokens[:cut] + tail, load, lock)

    @rule(ns=NAMESPACES, tokens=TOKENS, load=st.sampled_from(["no", "yes", "from_read"]),
          lock=st.booleans())
    def match(self, ns: str | None, tokens: list[int], load: bool | str, lock: bool) -> None:
        k = key(tokens, ns)
        m = self.cache.match_prefix(k)
        for i in range(m.num_pages):
            assert (ns, tuple(tokens[:(i + 1) * PS])) in self.inserted
        if load in (True, "yes"):
            m = self.cache.load_back(m)
        elif load == "from_read":     # as the engine does: read, then load back from that
            m = self.cache.load_back(m, self.cache.read_pages(m))
        assert torch.equal(self.cache.read_pages(m), page_data(k)[:m.num_pages])
        if lock:
            self.cache.lock(m.node)
            self.locks.append((m, [p.tier == Tier.DEVICE for p in m.pages]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        m, _ = self.locks.pop(i)
        self.cache.unlock(m.node)

    @rule(tier=st.sampled_from([Tier.DEVICE, Tier.HOST]), n=st.integers(0, 8))
    def evict(self, tier: Tier, n: int) -> None:
        assert 0 <= self.cache.evict(tier, n) <= n

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        assert self.cache.num_locks == len(self.locks)
        assert self.cache.num_device_pages == self.cache.device.used
        assert self.cache.num_host_pages == self.cache.host.used
        for stored, tier, names in self.cache.journal.drain():
            (self.replayed[tier].update if stored else self.replayed[tier].difference_update)(
                names)
        assert self.replayed == {t: set(n) for t, n in self.cache.held().items()}
        for m, on_device in self.locks:
            now = self.cache.refresh(m)
            assert m.node.attached and now.num_pages == m.num_pages
            assert all(p.tier == Tier.DEVICE for p, d in zip(now.pages, on_device,
                                                               strict=True) if d)
            assert torch.equal(self.cache.read_pages(now), page_data(m.key)[:m.num_pages])

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for m, _ in self.locks:
            self.cache.unlock(m.node)
        assert self.cache.num_locks == 0
        drain(self.cache)


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30,
                                          deadline=None)
TestRadixProperties = RadixMachine.TestCase
