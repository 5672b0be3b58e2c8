"""StorageTier actors and the sharded client on the session's local Ray cluster."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.vocab import MissReason
from pd_cache.storage import ExtraInfo, PageRecord, PoolTransfer, usable_prefix
from pd_cache.storage.client import StorageClient
from pd_cache.storage.disk import DiskBackend
from pd_cache.storage.shared import SharedMemoryBackend
from pd_cache.storage.tier import storage_actor, storage_actors, tier_backend
from tests.integration.clusters import alive, killed
from tests.unit.storage.records import Chain, assert_same

ray = pytest.importorskip("ray")

DTYPES = ["float32", "bfloat16", "float16"]


def config_for(kv_dtype: str = "float32", **storage: Any) -> PDCacheConfig:
    storage.setdefault("num_shards", 2)
    return PDCacheConfig(model=ModelConfig.preset("tiny", kv_dtype=kv_dtype),
                         cache=CacheConfig(page_size=4), storage=StorageConfig(**storage))


def kill_all(handles: list[Any]) -> None:
    for h in handles:
        ray.kill(h)


@pytest.fixture(scope="module")
def shards(ray_cluster: Any) -> Iterator[Callable[[str], list[Any]]]:
    """Two memory tier actors per KV dtype, created on first use, killed at the end."""
    made: dict[str, list[Any]] = {}

    def get(kv_dtype: str) -> list[Any]:
        if kv_dtype not in made:
            made[kv_dtype] = storage_actors(config_for(kv_dtype))
            ray.get([h.ping.remote() for h in made[kv_dtype]])
        return made[kv_dtype]

    yield get
    for handles in made.values():
        kill_all(handles)


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_round_trip_through_actors(shards: Callable[[str], list[Any]], kv_dtype: str,
                                   num_shards: int) -> None:
    handles = shards(kv_dtype)[:num_shards]
    client = StorageClient(handles)
    chain = Chain(config_for(kv_dtype).layout, 12, seed=num_shards)
    before = [h.usage.remote() for h in handles]
    assert client.batch_set(chain.names, chain.records) == [True] * 12
    assert client.batch_exists(chain.names) == 12
    got = client.batch_get([n.hex() for n in chain.names])
    for g, want in zip(got, chain.records):
        assert_same(g, want)
    if num_shards == 2:  # rendezvous spread the pages over both shards
        added = [after.records - b.records for after, b in
                 zip(ray.get([h.usage.remote() for h in handles]), ray.get(before))]
        assert sum(added) == 12 and min(added) > 0
        assert added[1] == sum(client.shard_of(n) == 1 for n in chain.names)


def test_v2_pools_over_shards(shards: Callable[[str], list[Any]]) -> None:
    client = StorageClient(shards("float32"))
    chain = Chain(config_for().layout, 8, seed=20, state_shape=(4, 4))
    acks = client.batch_set_v2([PoolTransfer("kv", chain.names, chain.records),
                                PoolTransfer("state", chain.names[:5], chain.states[:5])])
    assert acks == [[True] * 8, [True] * 5]
    hits = client.batch_exists_v2([PoolTransfer("kv", chain.names),
                                   PoolTransfer("state", chain.names)])
    assert hits.per_pool == {"kv": 8, "state": 5} and hits.usable == 5
    got = client.batch_get_v2([PoolTransfer("kv", chain.names),
                               PoolTransfer("state", chain.names)])
    assert usable_prefix(got) == 5
    for i in range(5):
        assert_same(got[1].pages[i], chain.states[i])
    # page 7's state alone, on whichever shard owns it: a prefix of all 8 pages ends there
    assert client.batch_set_v2([PoolTransfer("state", chain.names[7:], chain.states[7:])]) \
        == [[True]]
    ask = [PoolTransfer("kv", chain.names), PoolTransfer("state", chain.names[5:])]
    hits = client.batch_exists_v2(ask)
    assert hits.per_pool == {"kv": 8, "state": 0} and hits.usable == 8
    assert usable_prefix(client.batch_get_v2(ask)) == 8


def test_exists_is_the_consecutive_prefix_across_shards(
        shards: Callable[[str], list[Any]]) -> None:
    client = StorageClient(shards("float32"))
    chain = Chain(config_for().layout, 16, seed=21)
    owners = [client.shard_of(n) for n in chain.names]
    assert len(set(owners)) == 2
    gap = 9
    stored = [i for i in range(16) if i != gap]
    client.batch_set([chain.names[i] for i in stored], [chain.records[i] for i in stored])
    assert client.batch_exists(chain.names) == gap
    assert client.batch_exists(chain.names[gap + 1:]) == 16 - gap - 1
    pending = client.submit_get(chain.names)  # async: collect later
    got = pending.result()
    assert [g is not None for g in got] == [i != gap for i in range(16)]
    assert pending.faults == []


def test_prefix_keys_through_client(shards: Callable[[str], list[Any]]) -> None:
    # a page per segment: placed as without a chain, so this test may mix the two
    client = StorageClient(shards("float32"), segment_pages=1)
    chain = Chain(config_for().layout, 9, seed=22)
    other = Chain(config_for().layout, 1, extra_key="tenant-b")
    refused_before = client.stats().get("refused/namespace_refused", 0)
    # []: the chain must start at this namespace's seed
    assert client.batch_set(chain.names[:3], chain.records[:3],
                            ExtraInfo(prefix_keys=[], namespace_seed=other.seed)) == [
        False, True, True]
    prefix: list[bytes] = []
    handed = []
    for lo in range(0, 9, 3):
        batch = chain.names[lo:lo + 3]
        info = ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed)
        assert client.batch_set(batch, chain.records[lo:lo + 3], info) == [True] * 3
        assert client.batch_exists(batch, info) == 3
        handed.append((prefix, list(prefix)))
        prefix = prefix + batch
    assert all(given == copy for given, copy in handed)
    # the chain check holds across shards although no shard sees consecutive keys
    skip = [chain.names[i] for i in (0, 1, 3, 4)]
    assert client.batch_exists(skip, ExtraInfo(prefix_keys=[])) == 2
    assert client.batch_exists(skip, None) == 4  # feature off
    assert client.batch_get(chain.names[3:6], ExtraInfo(prefix_keys=chain.names[:1]))[0] is None
    assert client.stats()["refused/namespace_refused"] - refused_before == 3


def test_bad_input_through_client_stores_nothing(shards: Callable[[str], list[Any]]) -> None:
    handles = shards("float32")
    client = StorageClient(handles)
    chain = Chain(config_for().layout, 6, seed=23)
    before = client.usage()
    bad = PageRecord(chain.records[5].header, (chain.records[5].payload().reshape(-1),))
    with pytest.raises(ValueError, match=r"pages\[5\]: pool 'kv': payload shape"):
        client.batch_set(chain.names, chain.records[:5] + [bad])
    with pytest.raises(ValueError, match="5 records for 6 keys"):
        client.batch_set(chain.names, chain.records[:5])
    with pytest.raises(ValueError, match=r"keys\[1\]: page name: not a hex"):
        client.batch_exists([chain.names[0], "not hex"])
    assert client.usage() == before
    assert client.batch_exists(chain.names) == 0


def test_other_layout_is_refused_by_the_tier(shards: Callable[[str], list[Any]]) -> None:
    client = StorageClient(shards("float32"))
    other = Chain(config_for("float16").layout, 4, seed=24)
    assert client.batch_set(other.names, other.records) == [False] * 4
    assert client.batch_exists(other.names) == 0


def test_tier_refuses_a_record_that_fails_its_checksum(
        shards: Callable[[str], list[Any]]) -> None:
    client = StorageClient(shards("float32"))
    chain = Chain(config_for().layout, 3, seed=25)
    flipped = chain.records[1].payload().clone()
    flipped.view(torch.uint8).view(-1)[7] ^= 0x01
    records = [chain.records[0], PageRecord(chain.records[1].header, (flipped,)),
               chain.records[2]]
    refused = client.stats().get("refused/verification_failed", 0)
    assert client.batch_set(chain.names, records) == [True, False, True]
    assert client.stats()["refused/verification_failed"] - refused == 1
    assert client.batch_exists(chain.names) == 1


def test_dead_shard_is_a_miss_not_a_hang(ray_cluster: Any) -> None:
    client = StorageClient.from_config(config_for(), timeout_s=20)
    handles = client.handles
    try:
        chain = Chain(config_for().layout, 10, seed=25)
        assert client.batch_set(chain.names, chain.records) == [True] * 10
        killed(handles[1])
        owners = [client.shard_of(n) for n in chain.names]
        start = time.monotonic()
        pending = client.submit_get(chain.names)
        got = pending.result()
        assert [g is not None for g in got] == [o == 0 for o in owners]
        assert [f.reason for f in pending.faults] == [MissReason.STORAGE_ERROR]
        assert client.batch_exists(chain.names) == owners.index(1)
        assert client.batch_set(chain.names, chain.records) == [o == 0 for o in owners]
        assert time.monotonic() - start < 15
        stats = client.stats()  # the dead shard's counts are gone; the client's remain
        assert stats["miss/storage_error"] == owners.count(1) + 1
        assert stats["refused/storage_error"] == owners.count(1)
    finally:
        kill_all(handles)


def test_slow_shard_times_out(shards: Callable[[str], list[Any]]) -> None:
    client = StorageClient(shards("float32"))
    chain = Chain(config_for().layout, 400, seed=26)
    busy = client.submit_set(chain.names, chain.records)  # queued ahead of the next call
    pending = client.submit_exists(chain.names)
    assert pending.result(timeout=0) == 0
    assert {f.reason for f in pending.faults} == {MissReason.TIMEOUT}
    assert busy.result() == [True] * 400
    assert client.stats()["miss/timeout"] >= 1


def test_named_detached_actor_is_shared(ray_cluster: Any) -> None:
    config = config_for(num_shards=1)
    first = storage_actor(config, "pdc-test-l3", detached=True)
    try:
        second = storage_actor(config, "pdc-test-l3", detached=True)
        assert ray.get(first.ping.remote()) == ray.get(second.ping.remote())
        with pytest.raises(ValueError, match="detached"):
            storage_actor(config, None, detached=True)
    finally:
        ray.kill(first)


def test_disk_tier_restart_mid_stream(ray_cluster: Any, tmp_path: Path) -> None:
    config = config_for(backend="disk", disk_path=str(tmp_path), num_shards=1)
    layout = config.layout
    handle = storage_actor(config, max_restarts=2, max_task_retries=0)
    try:
        client = StorageClient([handle], timeout_s=60)
        pid = ray.get(handle.ping.remote())
        chain = Chain(layout, 101, seed=27)
        torn = plant_torn_record(tmp_path / "shard-0", layout, chain, 100)
        stream = [client.submit_set(chain.names[i:i + 4], chain.records[i:i + 4])
                  for i in range(0, 100, 4)]
        while sum(p.done() for p in stream) < 5:
            time.sleep(0.005)
        ray.kill(handle, no_restart=False)
        acks = [a for p in stream for a in p.result()]
        acked = [i for i, a in enumerate(acks) if a]
        assert 20 <= len(acked) < 100  # some writes acknowledged, some cut off
        assert wait_restarted(handle, pid)
        got = client.batch_get(chain.names)
        for i in acked:
            assert_same(got[i], chain.records[i])
        for i, g in enumerate(got[:100]):  # anything else served must be the real page
            assert g is None or bits_equal(g, chain.records[i])
        assert got[100] is None and not torn.exists()
        assert not list(tmp_path.rglob("*.tmp"))
        assert client.stats()["verification_failed/"] >= 1  # the torn file, at start
    finally:
        ray.kill(handle)


def plant_torn_record(shard_dir: Path, layout: Any, chain: Chain, i: int) -> Path:
    """A record file cut short (as a lying disk would leave it) and a temp file."""
    scratch = DiskBackend(shard_dir.parent / "scratch", layout, 1 << 20)
    scratch.batch_set(chain.names[i:i + 1], chain.records[i:i + 1])
    src = scratch._path(("kv", chain.names[i]))
    dst = shard_dir / src.relative_to(scratch.root.parent)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes()[:-100])
    dst.with_name(dst.name.replace(".rec", ".other.rec.tmp")).write_bytes(b"partial")
    return dst


def wait_restarted(handle: Any, old_pid: int, deadline_s: float = 60) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if ray.get(handle.ping.remote(), timeout=10) != old_pid:
                return True
        except ray.exceptions.RayError:
            time.sleep(0.2)
    return False


def bits_equal(got: PageRecord, want: PageRecord) -> bool:
    return got.header == want.header and all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(got.payloads, want.payloads))


# -- memory shards lend records through the object store ------------------------------------
SLACK = 4096  # object-store bytes a record costs beyond its payload (pickled header)


def object_store_bytes(cluster: Any) -> int:
    """Bytes in the node's object store now, by Ray's own accounting."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(get_state_from_address(cluster.address)) \
        .store_stats.object_store_bytes_used


def quiet_store_bytes(cluster: Any, deadline_s: float = 30) -> int:
    """Object-store bytes once they stop changing: objects of earlier tests' dead actors are
    freed asynchronously, and a baseline taken meanwhile would count them."""
    end, last = time.monotonic() + deadline_s, object_store_bytes(cluster)
    while time.monotonic() < end:
        time.sleep(0.25)
        now = object_store_bytes(cluster)
        if now == last:
            return now
        last = now
    return last


def settles(condition: Callable[[], bool], deadline_s: float = 30) -> bool:
    """Whether ``condition`` holds within the deadline (Ray frees objects asynchronously)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_memory_shard_lends_refs_and_the_client_verifies(
        shards: Callable[[str], list[Any]]) -> None:
    handles = shards("bfloat16")[:1]
    client = StorageClient(handles)  # no layout given: verifies against the shard's
    chain = Chain(config_for("bfloat16").layout, 6, seed=30)
    hits_before = client.stats().get("hit/", 0)
    assert client.batch_set(chain.names, chain.records) == [True] * 6
    answer = ray.get(handles[0].batch_get_shared_v2.remote(
        [PoolTransfer("kv", chain.names[:2] + [chain.names[0][::-1]])]))
    assert answer[0].lent
    # one object per write batch: both pages are in the one block the answer lends
    assert answer[0].pages == [(0, 0), (0, 1), None]
    assert [isinstance(b, ray.ObjectRef) for b in answer[0].blocks] == [True]
    got = client.batch_get(chain.names)
    for g, want in zip(got, chain.records):
        assert_same(g, want)
    assert client.stats()["hit/"] - hits_before == 2 + 6  # counted by the shard, once each


def test_damaged_lent_record_is_a_miss_and_is_discarded(ray_cluster: Any) -> None:
    config = config_for(num_shards=1)
    client = StorageClient.from_config(config)
    try:
        chain = Chain(config.layout, 4, seed=31)
        assert client.batch_set(chain.names, chain.records) == [True] * 4
        first = client.batch_get(chain.names)
        # NOTE: received pages are views of the shared object; a reader that writes into
        # one (callers must copy instead) damages the page for every later reader.
        first[2].payload().view(torch.uint8).view(-1)[0] ^= 0xFF
        del first
        got = client.batch_get(chain.names)
        assert [g is not None for g in got] == [True, True, False, True]
        assert_same(got[3], chain.records[3])
        assert client.batch_exists(chain.names) == 2  # discarded (calls run in order)
        stats = client.stats()
        assert stats["miss/verification_failed"] == 1 and stats["verification_failed/"] == 1
        assert client.batch_set(chain.names[2:3], chain.records[2:3]) == [True]
        assert_same(client.batch_get(chain.names)[2], chain.records[2])
    finally:
        kill_all(client.handles)


@pytest.mark.parametrize("restart", [False, True])
def test_killed_memory_shard_lent_pages_are_misses_not_a_hang(ray_cluster: Any,
                                                              restart: bool) -> None:
    config = config_for(num_shards=1)
    before = quiet_store_bytes(ray_cluster)
    handle = storage_actor(config, max_restarts=1 if restart else 0)
    client = StorageClient([handle], timeout_s=20, layout=config.layout)
    try:
        pid = ray.get(handle.ping.remote())
        chain = Chain(config.layout, 8, seed=32)
        assert client.batch_set(chain.names, chain.records) == [True] * 8
        pending = client.submit_get(chain.names)
        while not pending.done():  # the shard has lent its refs ...
            time.sleep(0.005)
        probe = ray.get(handle.batch_get_shared_v2.remote(
            [PoolTransfer("kv", chain.names[:1])]))[0].blocks[0]   # the batch's one block
        ray.kill(handle, no_restart=not restart)  # ... and dies with the objects
        if restart:
            assert wait_restarted(handle, pid)
        else:
            assert settles(lambda: not alive(handle))
        # NOTE: until Ray has freed the dead owner's objects, a reader may still map them
        # (whole and verified: a valid hit); once freed, they are lost.
        assert settles(lambda: object_store_bytes(ray_cluster) <= before)
        assert settles(lambda: lost(probe))  # other tests' objects may have gone meanwhile
        start = time.monotonic()
        assert pending.result() == [None] * 8
        assert time.monotonic() - start < 15
        assert [f.reason for f in pending.faults] == [MissReason.STORAGE_ERROR]
        assert client.stats()["miss/storage_error"] == 8
        if restart:  # a restarted memory shard is empty: plain misses from now on
            again = client.submit_get(chain.names)
            assert again.result() == [None] * 8 and again.faults == []
            assert client.stats()["miss/not_stored"] == 8
    finally:
        ray.kill(handle)


def lost(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=5)
        return False
    except ray.exceptions.RayError:
        return True


def test_lent_objects_are_freed_on_eviction_discard_and_death(ray_cluster: Any) -> None:
    base = PDCacheConfig(model=ModelConfig.preset("small"), cache=CacheConfig(page_size=16))
    page = base.layout
    page_bytes = page.page_nbytes
    capacity = 8 * page_bytes
    config = PDCacheConfig(model=base.model, cache=base.cache,
                           storage=StorageConfig(capacity_bytes=capacity, num_shards=1))
    client = StorageClient.from_config(config)
    before = quiet_store_bytes(ray_cluster)
    grown = lambda: object_store_bytes(ray_cluster) - before  # noqa: E731
    try:
        # 8 prompts of 4 pages (a store full of one long chain keeps its head instead)
        prompts = [Chain(config.layout, 4, seed=33 + i) for i in range(8)]
        names = [n for p in prompts for n in p.names]
        records = [r for p in prompts for r in p.records]
        for lo in range(0, 24, 4):  # 3x the capacity
            assert client.batch_set(names[lo:lo + 4], records[lo:lo + 4]) == [True] * 4
        assert client.usage().bytes <= capacity
        assert settles(lambda: grown() <= capacity + 8 * SLACK)
        held = client.batch_get(names[16:24])
        assert client.batch_set(names[24:], records[24:]) == [True] * 8
        # the shard evicted what the reader holds: its views stay valid until dropped
        assert client.batch_exists(names[16:24]) == 0
        for g, want in zip(held, records[16:24]):
            assert_same(g, want)
        assert grown() > capacity + 8 * SLACK
        del held, g
        assert settles(lambda: grown() <= capacity + 8 * SLACK)
        damaged = client.batch_get(names[24:25])[0]
        damaged.payload().view(torch.uint8).view(-1)[0] ^= 0xFF
        del damaged
        assert client.batch_get(names[24:25]) == [None]  # discarded by the shard
        assert settles(lambda: grown() <= capacity - page_bytes + 7 * SLACK)
    finally:
        kill_all(client.handles)
    assert settles(lambda: grown() <= 0)  # the rest died with the shard


def test_shared_backend_keeps_the_backend_contract(ray_cluster: Any, tmp_path: Path) -> None:
    config = config_for(num_shards=1)
    assert isinstance(tier_backend(config), SharedMemoryBackend)  # in a Ray process
    disk = config_for(backend="disk", disk_path=str(tmp_path), num_shards=1)
    assert isinstance(tier_backend(disk), DiskBackend)
    # 12 one-page prompts (a store full of one long chain keeps its head instead)
    prompts = [Chain(config.layout, 1, seed=34 + i) for i in range(12)]
    names, records = [p.names[0] for p in prompts], [p.records[0] for p in prompts]
    store = SharedMemoryBackend(config.layout, 4 * records[0].nbytes)
    for i in range(12):  # 3x the capacity; prompt 0 is used all along
        assert store.batch_set(names[i:i + 1], records[i:i + 1]) == [True]
        assert store.batch_get(names[:1])[0] is not None
        assert store.usage().records <= 4
    assert [store.batch_exists([n]) for n in names] == [1] + [0] * 8 + [1] * 3
    for got, want in zip(store.batch_get(names[9:]), records[9:]):
        assert_same(got, want)  # verified in this process
    lent = store.batch_lend_v2([PoolTransfer("kv", names[8:])])[0]
    assert lent.pages[0] is None and len(lent.blocks) == 3  # one block per write batch
    for (block, i), want in zip(lent.pages[1:], records[9:]):
        assert_same(ray.get(lent.blocks[block])[i], want)  # for a reader to verify
    with pytest.raises(ValueError, match="1 records for 2 keys"):
        store.batch_set(names[:2], records[:1])
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        store.discard_v2("kv", ["not hex"])
    assert store.discard_v2("kv", names[10:11]) == 1
    assert store.usage().records == 3
    stats = store.stats()
    assert stats["evicted/"] == 8 and stats["verification_failed/"] == 1
    assert stats["hit/"] == 12 + 3 + 3 and stats["miss/evicted"] == 8 + 1


def test_shared_backend_rewrites_blocks_past_the_dead_bytes_bound(ray_cluster: Any) -> None:
    config = config_for(num_shards=1)
    a, b = Chain(config.layout, 8, seed=40), Chain(config.layout, 3, seed=41)
    page_bytes = a.records[0].nbytes
    store = SharedMemoryBackend(config.layout, 8 * page_bytes)
    assert store.dead_bytes_bound == 2 * page_bytes
    assert store.batch_set(a.names, a.records) == [True] * 8   # one block of 8 pages
    first = store.batch_lend_v2([PoolTransfer("kv", a.names)])[0]
    assert len(first.blocks) == 1 and first.pages == [(0, i) for i in range(8)]
    for i in range(3):  # each page of b evicts a's tail page by page
        assert store.batch_set(b.names[i:i + 1], b.records[i:i + 1],
                               ExtraInfo(prefix_keys=b.names[:i])) == [True]
        assert store.batch_exists(a.names) == 7 - i
        assert store.dead_bytes == ((i + 1) * page_bytes if i < 2 else 0)
    lent = store.batch_lend_v2([PoolTransfer("kv", a.names[:5])])[0]
    assert len(lent.blocks) == 1 and lent.blocks[0] != first.blocks[0]  # rewritten
    assert lent.pages == [(0, i) for i in range(5)]
    block = ray.get(lent.blocks[0])
    assert len(block) == 5
    for got, want in zip(block, a.records):
        assert_same(got, want)
    assert store.usage().bytes == 8 * page_bytes and store.stats()["evicted/"] == 3
