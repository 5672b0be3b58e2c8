"""The memory and disk backends through the storage interface (real files, no Ray)."""

from __future__ import annotations

import logging
import os
import random
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from pd_cache.core.config import KVLayout, StorageConfig
from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.storage import (
    ExtraInfo,
    PageRecord,
    PoolTransfer,
    StorageBackend,
    make_backend,
    make_record,
    usable_prefix,
)
from pd_cache.storage.disk import DiskBackend
from pd_cache.storage.eviction import TailFirst
from pd_cache.storage.memory import MemoryBackend
from pd_cache.storage.record import PoolEntry
from tests.unit.storage.records import DTYPES, Chain, assert_same, bits, layout_for

Factory = Callable[..., StorageBackend]


@pytest.fixture(params=["memory", "disk"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Factory:
    def factory(layout: KVLayout | None = None, capacity: int = 1 << 24,
                path: Path | None = None, algo: str = "xxh3_128") -> StorageBackend:
        layout = layout or layout_for()
        if request.param == "memory":
            return MemoryBackend(layout, capacity, algo=algo)
        return DiskBackend(path or tmp_path / "l3", layout, capacity, algo=algo)
    factory.kind = request.param  # type: ignore[attr-defined]
    return factory


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(make_store: Factory, dtype: torch.dtype) -> None:
    layout = layout_for(dtype)
    store, chain = make_store(layout), Chain(layout, 5, seed=1)
    assert store.batch_set(chain.names, chain.records) == [True] * 5
    assert store.batch_exists(chain.names) == 5
    for got, want in zip(store.batch_get([n.hex() for n in chain.names]), chain.records):
        assert_same(got, want)
    assert store.stats() == {"hit/": 5, "stored/": 5}


def test_store_keeps_its_own_copy(make_store: Factory) -> None:
    chain = Chain(layout_for(), 1)
    store = make_store()
    before = bits(chain.records[0].payload())
    store.batch_set(chain.names, chain.records)
    chain.records[0].payload().zero_()  # the caller reuses its buffer
    got = store.batch_get(chain.names)[0]
    assert got is not None and bits(got.payload()) == before


def test_exists_counts_the_consecutive_prefix(make_store: Factory) -> None:
    store, chain = make_store(), Chain(layout_for(), 5)
    store.batch_set([chain.names[i] for i in (0, 1, 3)], [chain.records[i] for i in (0, 1, 3)])
    assert store.batch_exists(chain.names) == 2
    assert store.batch_exists(chain.names[3:]) == 1
    got = store.batch_get(chain.names)
    assert [g is not None for g in got] == [True, True, False, True, False]
    stats = store.stats()
    # one miss ends each exists prefix (pages 2 and 4), get misses pages 2 and 4
    assert stats["miss/not_stored"] == 2 + 2 and stats["hit/"] == 3


def test_v2_usable_hit_is_the_minimum_over_pools(make_store: Factory) -> None:
    chain = Chain(layout_for(), 4, state_shape=(3, 8))
    store = make_store()
    acks = store.batch_set_v2([PoolTransfer("kv", chain.names, chain.records),
                               PoolTransfer("state", chain.names[:2], chain.states[:2])])
    assert acks == [[True] * 4, [True] * 2]
    hits = store.batch_exists_v2([PoolTransfer("kv", chain.names),
                                  PoolTransfer("state", chain.names)])
    assert hits.per_pool == {"kv": 4, "state": 2} and hits.usable == 2
    assert store.batch_exists_v2([PoolTransfer("kv", chain.names)]).usable == 4
    got = store.batch_get_v2([PoolTransfer("kv", chain.names),
                              PoolTransfer("state", chain.names)])
    assert [t.pool for t in got] == ["kv", "state"] and usable_prefix(got) == 2
    assert_same(got[1].pages[1], chain.states[1])
    assert got[1].pages[2] is None and got[0].pages[3] is not None
    # v1 is the kv pool of v2
    assert store.batch_exists(chain.names) == 4


def test_v2_record_must_hold_its_pool(make_store: Factory) -> None:
    chain = Chain(layout_for(), 2, state_shape=(3, 8))
    store = make_store()
    assert store.batch_set_v2([PoolTransfer("state", chain.names, chain.records)]) == [
        [False, False]]
    assert store.stats() == {"refused/verification_failed": 2}


# -- prefix_keys --------------------------------------------------------------------------
def test_prefix_keys_states(make_store: Factory) -> None:
    chain, other = Chain(layout_for(), 6), Chain(layout_for(), 2, extra_key="lora-b", seed=3)
    store = make_store()
    # [] : the chain starts at the namespace seed; another namespace's seed is refused
    assert store.batch_set(chain.names[:2], chain.records[:2],
                           ExtraInfo(prefix_keys=[], namespace_seed=other.seed)) == [False, True]
    assert store.stats()["refused/namespace_refused"] == 1
    assert store.batch_set(chain.names[:2], chain.records[:2],
                           ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)) == [True, True]
    # non-empty: the first key must follow prefix_keys[-1]
    info = ExtraInfo(prefix_keys=chain.names[:1])
    assert store.batch_set(chain.names[3:4], chain.records[3:4], info) == [False]
    assert store.batch_set(chain.names[2:4], chain.records[2:4],
                           ExtraInfo(prefix_keys=chain.names[:2])) == [True, True]
    # None: feature off, a gap in the chain is not checked
    assert store.batch_set(chain.names[5:6], chain.records[5:6], None) == [True]
    assert store.batch_exists(chain.names[5:6], None) == 1
    assert store.batch_exists(chain.names[5:6], ExtraInfo(prefix_keys=chain.names[:4])) == 0


def test_non_contiguous_chain_is_refused(make_store: Factory) -> None:
    chain = Chain(layout_for(), 4)
    store = make_store()
    keys, records = [chain.names[i] for i in (0, 2, 3)], [chain.records[i] for i in (0, 2, 3)]
    acks = store.batch_set(keys, records, ExtraInfo(prefix_keys=[], namespace_seed=chain.seed))
    assert acks == [True, False, True]  # page 2 does not follow page 0; page 3 follows 2
    assert store.stats()["refused/namespace_refused"] == 1
    assert store.batch_exists(chain.names, ExtraInfo(prefix_keys=[])) == 1


def test_accumulating_prefix_keys_leaves_caller_lists_unchanged(make_store: Factory) -> None:
    chain = Chain(layout_for(), 6)
    store = make_store()
    prefix: list[bytes] = []
    handed: list[tuple[list[bytes], list[bytes]]] = []
    for lo in range(0, 6, 2):
        batch = chain.names[lo:lo + 2]
        info = ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed)
        assert store.batch_set(batch, chain.records[lo:lo + 2], info) == [True, True]
        assert store.batch_exists(batch, info) == 2
        handed.append((prefix, list(prefix)))
        prefix = prefix + batch
    for given, copy in handed:
        assert given == copy
    assert [len(g) for g, _ in handed] == [0, 2, 4]


def test_chain_from_another_namespace_is_never_returned(make_store: Factory) -> None:
    mine, theirs = Chain(layout_for(), 3), Chain(layout_for(), 3, extra_key="tenant-b")
    store = make_store()
    store.batch_set(theirs.names, theirs.records)
    # a reader in my namespace handed their keys (e.g. a namespace read from the wrong place)
    mine_info = ExtraInfo(prefix_keys=[], namespace_seed=mine.seed)
    assert store.batch_exists(theirs.names, mine_info) == 0
    assert store.batch_get(theirs.names, mine_info)[0] is None
    assert store.stats()["miss/namespace_refused"] == 2
    # their records are fine and stay: their own reader still gets them
    got = store.batch_get(theirs.names, ExtraInfo(prefix_keys=[], namespace_seed=theirs.seed))
    assert_same(got[0], theirs.records[0])
    # their record filed under my name is refused at the door
    assert store.batch_set(mine.names[:1], theirs.records[:1]) == [False]
    assert store.batch_exists(mine.names[:1]) == 0


def test_other_layout_is_refused(make_store: Factory) -> None:
    store = make_store(layout_for())
    other = Chain(layout_for(num_layers=3), 2)
    assert store.batch_set(other.names, other.records) == [False, False]
    assert store.usage().records == 0
    assert store.stats() == {"refused/verification_failed": 2}


def test_a_record_that_fails_its_checksum_is_refused_on_write(make_store: Factory) -> None:
    chain = Chain(layout_for(), 3)
    store = make_store()
    flipped = chain.records[1].payload().clone()
    flipped.view(torch.uint8).view(-1)[3] ^= 0x10
    entry = chain.records[2].header.pools[0]
    bad_sum = msgspec.structs.replace(chain.records[2].header, pools=(
        msgspec.structs.replace(entry, checksum=entry.checksum ^ 1),))
    records = [chain.records[0], PageRecord(chain.records[1].header, (flipped,)),
               PageRecord(bad_sum, chain.records[2].payloads)]
    assert store.batch_set(chain.names, records) == [True, False, False]
    assert store.stats()["refused/verification_failed"] == 2
    assert store.usage().records == 1 and store.batch_exists(chain.names) == 1


def test_flipped_payload_in_memory_is_dropped() -> None:
    store, chain = MemoryBackend(layout_for(), 1 << 20), Chain(layout_for(), 2)
    store.batch_set(chain.names, chain.records)
    got = store.batch_get(chain.names)[1]
    assert got is not None
    got.payload().view(-1)[0] += 1  # a reader that wrote into a read-only page
    assert store.batch_get(chain.names)[1] is None
    assert store.batch_exists(chain.names) == 1 and store.usage().records == 1
    stats = store.stats()
    assert stats["verification_failed/"] == 1 and stats["miss/verification_failed"] == 1


# -- disk: files, restart, corruption -------------------------------------------------------
def record_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.rec"))


def test_disk_flipped_bytes_are_never_served(tmp_path: Path) -> None:
    layout = layout_for()
    store, chain = DiskBackend(tmp_path, layout, 1 << 20), Chain(layout, 3)
    store.batch_set(chain.names, chain.records)
    paths = [store._path(("kv", n)) for n in chain.names]
    flip(paths[0], offset=-5)  # payload byte
    flip(paths[1], offset=20)  # header byte
    got = store.batch_get(chain.names)
    assert got[0] is None and got[1] is None
    assert_same(got[2], chain.records[2])
    assert not paths[0].exists() and not paths[1].exists()
    assert store.stats()["verification_failed/"] == 2
    assert store.batch_exists(chain.names[2:]) == 1 and store.usage().records == 1


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_disk_restart_serves_everything_and_drops_torn_files(tmp_path: Path) -> None:
    layout = layout_for(torch.bfloat16)
    chain = Chain(layout, 6, seed=5)
    first = DiskBackend(tmp_path, layout, 1 << 20)
    assert first.batch_set(chain.names[:4], chain.records[:4]) == [True] * 4
    # a torn copy of page 4's file, a leftover temp file, a foreign file, another namespace's
    # page renamed to one of mine
    other = DiskBackend(tmp_path / "other", layout, 1 << 20)
    other.batch_set(chain.names[4:6], chain.records[4:6])
    torn = first._path(("kv", chain.names[4]))
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(other._path(("kv", chain.names[4])).read_bytes()[:-7])
    (torn.parent / (torn.name + ".tmp")).write_bytes(b"half")
    (first.root / "zz").mkdir()
    (first.root / "zz" / "junk.kv.rec").write_bytes(b"junk")
    wrong = first._path(("kv", chain.names[5]))
    wrong.parent.mkdir(exist_ok=True)
    wrong.write_bytes(first._path(("kv", chain.names[0])).read_bytes())

    second = DiskBackend(tmp_path, layout, 1 << 20)
    assert second.usage().records == 4
    assert second.stats() == {"verification_failed/": 3}
    got = second.batch_get(chain.names)
    for i in range(4):
        assert_same(got[i], chain.records[i])
    assert got[4:] == [None, None]
    assert len(record_files(second.root)) == 4
    assert not list(second.root.rglob("*.tmp"))


class V2Header(msgspec.Struct, frozen=True):
    """The header of record version 2, which held the page's token ids in clear."""

    version: int
    fingerprint: str
    algo: str
    name: bytes
    prior: bytes
    tokens: tuple[int, ...]
    pools: tuple[PoolEntry, ...]
    seed: bytes = b""
    seal: None = None   # (not in the v2 format: read by the writer's layout only)


def test_disk_restart_drops_records_of_an_older_version(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    layout = layout_for()
    chain = Chain(layout, 3)
    first = DiskBackend(tmp_path, layout, 1 << 20)
    assert first.batch_set(chain.names[:2], chain.records[:2]) == [True, True]
    # page 2 as a version-2 file: same frame and payloads, its tokens in the header
    rec, ps = chain.records[2], layout.page_size
    old = V2Header(2, rec.header.fingerprint, rec.header.algo, rec.name, rec.header.prior,
                   tuple(chain.tokens[2 * ps:3 * ps]), rec.header.pools, rec.header.seed)
    path = first._path(("kv", rec.name))
    path.parent.mkdir(exist_ok=True)
    first._write_file(path, PageRecord(old, rec.payloads))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="pd_cache.storage.disk"):
        second = DiskBackend(tmp_path, layout, 1 << 20)
    assert "record version 2, expected 4" in caplog.text
    assert second.usage().records == 2 and not path.exists()
    assert second.stats() == {"verification_failed/": 1}
    assert second.batch_exists(chain.names) == 2


def modes_under(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of every directory and every file under ``root``."""
    dirs, files = set(), set()
    for path in root.rglob("*"):
        (dirs if path.is_dir() else files).add(stat.S_IMODE(os.stat(path).st_mode))
    return dirs, files


def test_disk_files_and_directories_are_private(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    layout = layout_for()
    chain = Chain(layout, 4)
    config = StorageConfig(backend="disk", disk_path=str(tmp_path / "l3"))
    umask = os.umask(0o002)  # permissive: group-writable, world-readable
    try:
        older = DiskBackend.from_config(config, layout)
        assert older.batch_set(chain.names[:1], chain.records[:1]) == [True]
        for path in (tmp_path / "l3").rglob("*"):  # a tree an older version left open
            path.chmod(0o775 if path.is_dir() else 0o664)
        tmp_modes: list[int] = []
        replace = os.replace

        def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            tmp_modes.append(stat.S_IMODE(os.stat(src).st_mode))
            replace(src, dst)

        monkeypatch.setattr(os, "replace", spy)
        with caplog.at_level(logging.INFO, logger="pd_cache.storage.disk"):
            store = DiskBackend.from_config(config, layout)
        assert store.batch_set(chain.names, chain.records) == [True] * 4
        fresh = DiskBackend(tmp_path / "new" / "deep", layout, 1 << 20)
        assert fresh.batch_set(chain.names[:1], chain.records[:1]) == [True]
    finally:
        os.umask(umask)
    assert tmp_modes == [0o600] * 4  # temp files too, before the rename
    assert modes_under(tmp_path / "l3") == ({0o700}, {0o600})
    assert modes_under(tmp_path / "new") == ({0o700}, {0o600})
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700  # created by the store
    tightened = [r for r in caplog.records if "private" in r.getMessage()]
    assert len(tightened) == 1, caplog.text
    assert store.batch_exists(chain.names) == 4


def test_disk_partitions_layouts_under_one_path(tmp_path: Path) -> None:
    a, b = layout_for(), layout_for(num_layers=3)
    chain_a, chain_b = Chain(a, 1), Chain(b, 1)
    DiskBackend(tmp_path, a, 1 << 20).batch_set(chain_a.names, chain_a.records)
    DiskBackend(tmp_path, b, 1 << 20).batch_set(chain_b.names, chain_b.records)
    assert DiskBackend(tmp_path, a, 1 << 20).batch_exists(chain_a.names) == 1
    assert DiskBackend(tmp_path, b, 1 << 20).batch_exists(chain_b.names) == 1
    assert len(record_files(tmp_path)) == 2


# -- capacity -------------------------------------------------------------------------------
def page_footprint(make_store: Factory, layout: KVLayout, path: Path) -> int:
    probe, chain = make_store(layout, 1 << 30, path), Chain(layout, 1, seed=99)
    probe.batch_set(chain.names, chain.records)
    return probe.usage().bytes


def kept(store: StorageBackend, chain: Chain) -> list[int]:
    """Which pages of ``chain`` the store holds, one by one (``exists`` changes no recency)."""
    return [store.batch_exists([n]) for n in chain.names]


def head(n: int, of: int) -> list[int]:
    return [1] * n + [0] * (of - n)


def test_three_times_capacity_stays_bounded_and_evicts_lru_first(make_store: Factory,
                                                                  tmp_path: Path) -> None:
    layout = layout_for()
    chains = [Chain(layout, 1, seed=i) for i in range(30)]  # 30 one-page prompts
    capacity = 10 * page_footprint(make_store, layout, tmp_path / "probe")
    store = make_store(layout, capacity)
    for i, chain in enumerate(chains):
        assert store.batch_set(chain.names, chain.records) == [True]
        if i >= 2:  # prompt 0 is used all along: it must survive
            assert store.batch_get(chains[0].names)[0] is not None
        usage = store.usage()
        assert usage.bytes <= capacity and usage.records <= 10
    present = [store.batch_exists(c.names) for c in chains]
    assert present == [1] + [0] * 20 + [1] * 9
    stats = store.stats()
    assert stats["evicted/"] == 20
    assert stats["miss/evicted"] == 20
    if make_store.kind == "disk":  # type: ignore[attr-defined]
        assert len(record_files(tmp_path / "l3")) == 10


def test_two_prompts_over_capacity_keep_head_prefixes(make_store: Factory,
                                                      tmp_path: Path) -> None:
    layout = layout_for()
    first, second = Chain(layout, 8, seed=1), Chain(layout, 8, seed=2)
    store = make_store(layout, 10 * page_footprint(make_store, layout, tmp_path / "probe"))
    for chain in (first, second):
        info = ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)
        assert store.batch_set(chain.names, chain.records, info) == [True] * 8
    # the least recently used prompt lost its tail, never its head
    assert kept(store, first) == head(2, 8) and kept(store, second) == head(8, 8)
    assert store.batch_exists(first.names) == 2 and store.batch_exists(second.names) == 8
    assert store.usage().records == 10 and store.stats()["evicted/"] == 6


def test_a_hit_refreshes_its_prompt(make_store: Factory, tmp_path: Path) -> None:
    layout = layout_for()
    a, b, c = (Chain(layout, 4, seed=s) for s in (1, 2, 3))
    store = make_store(layout, 10 * page_footprint(make_store, layout, tmp_path / "probe"))
    store.batch_set(a.names, a.records)
    store.batch_set(b.names, b.records)
    assert all(store.batch_get(a.names))  # a is now more recent than b
    store.batch_set(c.names, c.records)
    assert [kept(store, x) for x in (a, b, c)] == [head(4, 4), head(2, 4), head(4, 4)]


def test_a_prompt_longer_than_capacity_keeps_its_head(make_store: Factory,
                                                      tmp_path: Path) -> None:
    layout = layout_for()
    chain = Chain(layout, 30)
    store = make_store(layout, 10 * page_footprint(make_store, layout, tmp_path / "probe"))
    prefix: list[bytes] = []
    for i in range(30):  # page by page, as decode offloads them
        info = ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed)
        assert store.batch_set(chain.names[i:i + 1], chain.records[i:i + 1], info) == [True]
        assert store.batch_get(chain.names[:1])[0] is not None
        prefix = prefix + chain.names[i:i + 1]
    # a page past the room is the chain's tail: it goes first, and so do pages after it
    assert kept(store, chain) == head(10, 30) and store.batch_exists(chain.names) == 10
    stats = store.stats()
    assert stats["stored/"] == 30 and stats["evicted/"] == 20
    assert stats["miss/evicted"] == 20 + 1  # each page asked alone, then the whole chain
    if make_store.kind == "disk":  # type: ignore[attr-defined]
        assert len(record_files(tmp_path / "l3")) == 10


def test_a_shared_prefix_stays_while_a_branch_needs_it(make_store: Factory,
                                                       tmp_path: Path) -> None:
    layout = layout_for()
    trunk = Chain(layout, 6, seed=1)
    branch = Chain(layout, 6, seed=2, shared=(trunk, 3))
    other = Chain(layout, 4, seed=3)
    assert branch.names[:3] == trunk.names[:3] and branch.names[3] != trunk.names[3]
    store = make_store(layout, 8 * page_footprint(make_store, layout, tmp_path / "probe"))
    store.batch_set(trunk.names, trunk.records)
    store.batch_set(branch.names, branch.records)  # pages 0-2 are there: refreshed
    assert kept(store, trunk) == head(5, 6) and kept(store, branch) == head(6, 6)
    store.batch_set(other.names, other.records)
    assert kept(store, trunk) == head(3, 6) and kept(store, branch) == head(4, 6)
    assert kept(store, other) == head(4, 4)


def test_a_shard_links_the_pages_it_holds_of_a_chain() -> None:
    layout = layout_for()
    chain, other = Chain(layout, 8, seed=1), Chain(layout, 2, seed=2)
    store = MemoryBackend(layout, 4 * chain.records[0].nbytes)
    # shard 0 of 2 gets every other page, with the priors the client computed
    mine = list(range(0, 8, 2))
    acks = store.batch_set_v2([PoolTransfer("kv", [chain.names[i] for i in mine],
                                            [chain.records[i] for i in mine],
                                            [chain.priors[i] for i in mine])],
                              ExtraInfo(prefix_keys=[], namespace_seed=chain.seed))
    assert acks == [[True] * 4]
    store.batch_set(other.names, other.records)
    assert [store.batch_exists([chain.names[i]]) for i in mine] == [1, 1, 0, 0]


def test_serving_under_pressure_keeps_only_head_prefixes() -> None:
    layout = layout_for()
    rng = random.Random(7)
    prompts = [Chain(layout, rng.randint(2, 9), seed=s) for s in range(6)]
    prompts += [Chain(layout, 8, seed=10 + s, shared=(prompts[s], 2)) for s in range(3)]
    store = MemoryBackend(layout, 14 * prompts[0].records[0].nbytes)
    for _ in range(300):
        p = rng.choice(prompts)
        hit = store.batch_exists(p.names, ExtraInfo(prefix_keys=[], namespace_seed=p.seed))
        if rng.random() < 0.5:
            store.batch_get(p.names[:hit])
        info = ExtraInfo(prefix_keys=p.names[:hit], namespace_seed=p.seed)
        assert all(store.batch_set(p.names[hit:], p.records[hit:], info))
        for q in prompts:
            held = kept(store, q)
            assert held == head(sum(held), len(held)), "a page kept without its head"
    assert store.usage().records <= 14


def test_tail_first_order() -> None:
    policy, kv = TailFirst(), lambda i: ("kv", bytes([i]))
    seed = ("kv", b"seed")
    for i in range(4):  # a0 <- a1 <- a2 <- a3
        policy.add(kv(i), kv(i - 1) if i else seed)
    policy.add(kv(10), seed)  # b0, more recent than all of a
    assert policy.victim() == kv(3)
    policy.touch(kv(0))  # the head of a: a's pages after it are not refreshed
    for want in (3, 2, 1):
        assert policy.victim() == kv(want)
        policy.remove(kv(want))
    assert policy.victim() == kv(10)  # a0 was touched after b0
    policy.add(kv(20), ("kv", b"gone"), orphan=True)
    assert policy.victim() == kv(20)
    for _ in range(10_000):  # stale heap entries stay bounded
        policy.touch(kv(0))
    assert len(policy._leaves) <= 2 * 3 + 64
    policy.remove(kv(20))
    assert [policy.victim(), policy.remove(kv(10)), policy.victim()] == [kv(10), None, kv(0)]


def test_disk_recency_survives_restart(tmp_path: Path) -> None:
    layout = layout_for()
    chains = [Chain(layout, 1, seed=i) for i in range(4)]
    store = DiskBackend(tmp_path, layout, 1 << 20)
    for i, chain in enumerate(chains[:3]):
        store.batch_set(chain.names, chain.records)
        os.utime(store._path(("kv", chain.names[0])), (1000 + i, 1000 + i))
    size = store.usage().bytes // 3
    restarted = DiskBackend(tmp_path, layout, 3 * size)
    restarted.batch_get(chains[0].names)  # prompt 0 becomes the most recent
    restarted.batch_set(chains[3].names, chains[3].records)
    assert [restarted.batch_exists(c.names) for c in chains] == [1, 0, 1, 1]


def test_disk_restart_rebuilds_the_chains(tmp_path: Path) -> None:
    layout = layout_for()
    first, second, third = Chain(layout, 8, seed=1), Chain(layout, 2, seed=2), Chain(
        layout, 4, seed=3)
    store = DiskBackend(tmp_path, layout, 1 << 20)
    for t, (chain, i) in enumerate([(first, i) for i in range(8)] + [(second, 0), (second, 1)]):
        store.batch_set(chain.names[i:i + 1], chain.records[i:i + 1])
        os.utime(store._path(("kv", chain.names[i])), (1000 + t, 1000 + t))
    restarted = DiskBackend(tmp_path, layout, store.usage().bytes)
    restarted.batch_set(third.names, third.records)
    assert kept(restarted, first) == head(4, 8) and kept(restarted, second) == head(2, 2)
    # a smaller capacity at start evicts the same way
    smaller = DiskBackend(tmp_path, layout, 8 * (store.usage().bytes // 10))
    assert kept(smaller, first) == head(2, 8) and kept(smaller, third) == head(4, 4)


# -- bad input ------------------------------------------------------------------------------
def bad_calls(chain: Chain) -> dict[str, Callable[[StorageBackend], object]]:
    rec = chain.records[1]
    reshaped = PageRecord(rec.header, (rec.payload().reshape(-1),))
    retyped = PageRecord(rec.header, (rec.payload().to(torch.float16),))
    return {
        "records: 1 records for 2 keys": lambda s: s.batch_set(chain.names[:2],
                                                               chain.records[:1]),
        "not a hex string": lambda s: s.batch_set(["zz" * 16, chain.names[1]],
                                                  chain.records[:2]),
        "expected 16": lambda s: s.batch_set([chain.names[0], chain.names[1][:8]],
                                             chain.records[:2]),
        "expected one of": lambda s: s.batch_get([chain.names[0].hex()[:30]]),
        "payload shape": lambda s: s.batch_set(chain.names[:2], [chain.records[0], reshaped]),
        "payload dtype": lambda s: s.batch_set(chain.names[:2], [chain.records[0], retyped]),
        "PageRecord": lambda s: s.batch_set(chain.names[:2], [chain.records[0], b"x"]),
        "appears twice": lambda s: s.batch_set_v2([PoolTransfer("kv", chain.names[:1],
                                                                chain.records[:1])] * 2),
        "pool": lambda s: s.batch_exists_v2([PoolTransfer("k v", chain.names)]),
        "prefix_keys": lambda s: s.batch_exists(chain.names, ExtraInfo(prefix_keys=["ab"])),
        "exceeds capacity": lambda s: s.batch_set(chain.names[:1], [Chain(
            layout_for(num_layers=200), 1).records[0]]),
    }


@pytest.mark.parametrize("case", list(bad_calls(Chain(layout_for(), 2))))
def test_bad_input_raises_and_changes_nothing(make_store: Factory, case: str) -> None:
    chain = Chain(layout_for(), 2)
    store = make_store(capacity=1 << 16)
    store.batch_set(chain.names[:1], chain.records[:1])
    usage, stats = store.usage(), store.stats()
    with pytest.raises(ValueError, match=case.split(": ")[-1] if ":" in case else case):
        bad_calls(chain)[case](store)
    assert store.usage() == usage and store.stats() == stats
    assert store.batch_exists(chain.names) == 1


def test_registry_builds_backends_from_config(tmp_path: Path) -> None:
    layout = layout_for()
    mem = make_backend(StorageConfig(capacity_bytes=4096, num_shards=2), layout)
    assert isinstance(mem, MemoryBackend) and mem.usage().capacity_bytes == 2048
    disk = make_backend(StorageConfig(backend="disk", disk_path=str(tmp_path)), layout,
                        algo="sha256", shard=1)
    assert isinstance(disk, DiskBackend) and disk.algo == "sha256"
    assert disk.root.parent == tmp_path / "shard-1"
    with pytest.raises(ValueError, match="unknown backend"):
        from pd_cache.storage import backend_class
        backend_class("tape")


def test_sha256_names(make_store: Factory) -> None:
    layout = layout_for()
    tokens = list(range(8))
    names = page_hashes(tokens, 4, algo="sha256")
    priors = [namespace_seed(None, None, "sha256"), names[0]]
    recs = [make_record(n, p, tokens[i * 4:(i + 1) * 4], {"kv": torch.ones(layout.page_shape)},
                        fingerprint=layout.fingerprint, algo="sha256")
            for i, (n, p) in enumerate(zip(names, priors))]
    store = make_store(layout, algo="sha256")
    assert store.batch_set(names, recs) == [True, True]
    assert store.batch_exists([n.hex() for n in names]) == 2
    with pytest.raises(ValueError, match="expected 32"):
        store.batch_exists([n[:16] for n in names])


def test_kv_events_replayed_give_what_the_store_holds(make_store: Factory) -> None:
    """Stored, evicted (tails first, past capacity), discarded and cleared pages each reach
    the journal, in order: replayed, they are exactly the kv names the store holds."""
    from pd_cache.core.events import EventLog
    from pd_cache.storage import PoolTransfer

    layout = layout_for()
    chain = Chain(layout, 12)
    store = make_store(layout, capacity=5 * layout.page_nbytes + 4096)
    store.journal = EventLog()
    held: set[bytes] = set()

    def replay() -> set[bytes]:
        for stored, tier, names in store.journal.drain():
            assert tier == "storage"
            (held.update if stored else held.difference_update)(names)
        return held

    for lo in range(0, 12, 4):
        store.batch_set_v2([PoolTransfer("kv", chain.names[lo:lo + 4],
                                         chain.records[lo:lo + 4])])
        assert replay() == set(store.held()["storage"])
    assert 0 < len(held) < 12                        # the bound evicted some
    store.discard_v2("kv", [next(iter(held))])
    assert replay() == set(store.held()["storage"])
    store.clear()
    assert replay() == set() == set(store.held()["storage"])
