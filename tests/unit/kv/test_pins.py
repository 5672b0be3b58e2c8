"""Pins with a TTL on an injected clock: held until they lapse, renewed by each hit, bounded
by each pool's fraction, a pinned page held in one tier (device or host) of the worker."""

from __future__ import annotations

import pytest
import torch

from pd_cache.core.config import CacheConfig, KVLayout
from pd_cache.core.pins import Pins
from pd_cache.core.vocab import Tier
from pd_cache.kv import CacheKey, PagePool, RadixCache
from tests.unit.clock import Clock

PS = 2
LAYOUT = KVLayout(model_id="t", kv_dtype="float32", num_layers=1, page_size=PS,
                  num_kv_heads=1, head_dim=2)



def test_a_pin_lapses_at_its_ttl_and_each_hit_renews_it() -> None:
    clock = Clock()
    pins: Pins[str] = Pins(clock)
    pins.pin("a", 10.0, "acme")
    pins.pin("b", 5.0)
    clock.now += 8
    pins.touch("a")                      # renewed: until 118
    assert pins.held("a") and not pins.held("b")
    assert pins.expired() == ["b"] and "b" not in pins
    clock.now += 9
    assert pins.held("a") and pins.expired() == []
    pins.pin("a", 1.0)                   # a shorter pin keeps the later expiry and its TTL
    assert [(k, p.until, p.ttl_s, p.owner) for k, p in pins.items()] == \
        [("a", 118.0, 10.0, "acme")]
    clock.now += 2
    pins.touch("a")                      # a lapsed pin is not revived by a late hit
    assert not pins.held("a") and pins.expired() == ["a"] and not pins


def cache(clock: Clock, device: int = 4, host: int = 4) -> RadixCache:
    return RadixCache(PagePool("device", device, LAYOUT), PagePool("host", host, LAYOUT),
                      clock=clock)


def put(c: RadixCache, first: int, pages: int = 2) -> CacheKey:
    key = CacheKey.build([first] * (PS * pages), page_size=PS)
    c.insert(key, torch.rand(pages, *LAYOUT.page_shape))
    return key


def test_pinned_pages_stay_in_the_worker_until_the_pin_lapses() -> None:
    clock = Clock()
    c = cache(clock)
    pinned = put(c, 1)
    assert c.pin(c.match_prefix(pinned).node, 30.0, "acme") == 2
    for i in range(2, 12):               # a flood of unpinned prompts, both pools full
        put(c, i)
        c.evict(Tier.HOST, 4)
        c.evict(Tier.DEVICE, 4)
    assert c.match_prefix(pinned).count(Tier.HOST) == 2   # held on host, off the device
    assert {p.owner for p in c.pinned()} == {"acme"} and len(c.pinned("acme")) == 2
    clock.now += 29                      # the match above renewed the pin to 130
    put(c, 20)
    assert c.match_prefix(pinned).num_pages == 2   # renews it again, to 159
    clock.now += 60
    put(c, 21)
    put(c, 22)
    c.evict(Tier.HOST, 4)
    assert c.match_prefix(pinned).num_pages == 0 and not c.pins
    c.clear()
    c.check_invariants()
    assert c.device.used == c.host.used == 0


def held_on(c: RadixCache) -> tuple[int, int]:
    """Pinned pages held on device and on host: checked against each pool's fraction."""
    on_device = len(c._device_pins)
    assert all(n.device_slot is not None for n in c._device_pins)
    on_host = [n for n, _ in c.pins.items() if n not in c._device_pins]
    assert all(n.host_slot is not None for n in on_host)
    f = c.max_pinned_fraction
    assert on_device <= int(f * c.device.capacity) and len(on_host) <= int(f * c.host.capacity)
    return on_device, len(on_host)


def test_a_pin_longer_than_half_the_smaller_pool_fits_in_both_and_survives_a_flood() -> None:
    clock = Clock()
    c = cache(clock, device=8, host=8)   # half of each: 4 + 4 pinned pages at most
    long = put(c, 1, pages=6)            # more than half of either pool alone
    assert c.max_pinned_pages == 8
    assert c.pin(c.match_prefix(long).node, 30.0, "a") == 6
    assert held_on(c) == (2, 4)          # the leading 2 held on device, the rest on host
    for i in range(2, 14):               # a flood that fills both pools, again and again
        put(c, i, pages=3)
        c.evict(Tier.HOST, 8)
        c.evict(Tier.DEVICE, 8)
    match = c.match_prefix(long)
    assert (match.count(Tier.DEVICE), match.count(Tier.HOST)) == (2, 4)
    c.load_back(match)                   # back on device for a request; held as before
    assert held_on(c) == (2, 4)
    other = put(c, 30, pages=4)          # only 2 more fit, both on device
    assert c.pin(c.match_prefix(other).node, 30.0, "b") == 2
    assert held_on(c) == (4, 4)
    assert c.drop_pins("a") == 6 and held_on(c) == (2, 0)
    c.clear()
    c.check_invariants()
    assert c.device.used == c.host.used == 0


def test_no_pool_is_more_than_the_fraction_pinned_and_drop_pins_frees_them() -> None:
    clock = Clock()
    c = cache(clock, device=4, host=0)   # no host pool: half the device, 2 pages
    first, second = put(c, 1, pages=3), put(c, 2)
    assert c.pin(c.match_prefix(first).node, 30.0, "a") == 2
    assert c.pin(c.match_prefix(second).node, 30.0, "b") == 0
    assert c.drop_pins("b") == 0 and c.drop_pins("a") == 2 and not c.pins
    assert c.evict(Tier.DEVICE, 4) == 4   # evictable again
    c.clear()
    c.check_invariants()


def test_the_fraction_is_checked() -> None:
    with pytest.raises(ValueError, match="cache.max_pinned_fraction"):
        CacheConfig(max_pinned_fraction=1.5)
    with pytest.raises(ValueError, match="cache.max_pinned_fraction"):
        cache(Clock()).__class__(PagePool("device", 1, LAYOUT), PagePool("host", 1, LAYOUT),
                                 max_pinned_fraction=-0.1)
