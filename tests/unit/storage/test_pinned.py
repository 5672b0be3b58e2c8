"""L3 pins on an injected clock: a pinned chain outlives a flood that evicts everything
else until its pin lapses, a hit renews it, and no shard is more than the fraction pinned."""

from __future__ import annotations

from pd_cache.core.config import KVLayout
from pd_cache.storage import ExtraInfo
from pd_cache.storage.eviction import TailFirst
from pd_cache.storage.memory import MemoryBackend
from tests.unit.clock import Clock
from tests.unit.storage.records import Chain, layout_for


def test_a_pinned_chain_survives_a_flood_until_its_pin_lapses() -> None:
    layout, clock = layout_for(), Clock(0.0)
    size = _page_bytes(layout)
    store = MemoryBackend(layout, 10 * size)
    store.pins.clock = clock
    pinned, unpinned = Chain(layout, 3, seed=1), Chain(layout, 2, seed=2)
    assert store.batch_set(pinned.names, pinned.records, ExtraInfo(pin_ttl_s=60.0)) == [True] * 3
    store.batch_set(unpinned.names, unpinned.records)
    for i in range(3, 20):                                  # a flood of 2 pages each
        flood = Chain(layout, 2, seed=i)
        store.batch_set(flood.names, flood.records)
        assert store.usage().bytes <= 10 * size
    assert store.batch_exists(pinned.names) == 3 and store.batch_exists(unpinned.names) == 0
    assert store.pins.listing("") == {"names": sorted(n.hex() for n in pinned.names),
                                      "bytes": 3 * size, "expires_in_s": 60.0}
    clock.now = 50.0
    assert store.batch_get(pinned.names)[2] is not None      # a hit: until 110 now
    clock.now = 100.0
    store.batch_set(*_one(Chain(layout, 2, seed=30)))
    assert store.batch_exists(pinned.names) == 3
    clock.now = 111.0
    for i in range(40, 46):
        store.batch_set(*_one(Chain(layout, 2, seed=i)))
    assert store.batch_exists(pinned.names) == 0 and not store.pins and store.pins.nbytes == 0


def test_no_more_than_the_fraction_is_pinned_and_drop_owner_unpins() -> None:
    layout = layout_for()
    size = _page_bytes(layout)
    store = MemoryBackend(layout, 8 * size)   # half of it: 4 pages
    chain = Chain(layout, 6, seed=1)
    store.batch_set(chain.names, chain.records, ExtraInfo(pin_ttl_s=5.0))
    assert len(store.pins) == 4 and store.pins.nbytes == 4 * size
    assert store.pins.drop_owner("") == [("kv", n) for n in chain.names[:4]]
    assert store.pins.listing("")["names"] == []
    more = Chain(layout, 8, seed=2)                     # evicts the unpinned ones first
    store.batch_set(more.names, more.records)
    assert not store.pins and store.pins.nbytes == 0 and store.batch_exists(chain.names) == 0


def test_a_held_victim_is_set_aside_until_released() -> None:
    held = {("kv", b"a")}
    policy = TailFirst(lambda slot: slot in held)
    policy.add(("kv", b"a"), ("kv", b"seed"))
    policy.add(("kv", b"b"), ("kv", b"seed"))
    assert policy.victim() == ("kv", b"b")
    policy.remove(("kv", b"b"))
    assert policy.victim() is None
    held.clear()
    policy.release(("kv", b"a"))
    assert policy.victim() == ("kv", b"a")


def _page_bytes(layout: KVLayout) -> int:
    probe = MemoryBackend(layout, 1 << 30)
    probe.batch_set(*_one(Chain(layout, 1)))
    return probe.usage().bytes


def _one(chain: Chain) -> tuple[list[bytes], list[object]]:
    return chain.names, chain.records
