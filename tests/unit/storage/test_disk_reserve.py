"""The disk backend keeps a free-space reserve on its filesystem, whoever else fills it.

Tails of the least recently used chains go first to keep it; a page that still would eat
into it is refused and counted ``refused/disk_full`` (and a later lookup misses with reason
``disk_full``), never a silent log line. First with free-space readings injected (the
filesystem's use is the store's files plus what "another service" wrote), then on a real
8 MiB tmpfs.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_cache.core.config import StorageConfig
from pd_cache.storage import make_backend
from pd_cache.storage.disk import DiskBackend, DiskSpace
from tests.unit.storage.records import Chain, layout_for

BLOCK = 256
RECORD = 1280   # a record of layout_for() on disk, a whole number of blocks


class SharedDisk(DiskBackend):
    """A disk backend whose filesystem is ``total`` bytes, holding its own files and
    ``other`` bytes written by someone else."""

    total = 40 * RECORD
    other = 0

    def _filesystem(self) -> DiskSpace:
        return DiskSpace(self.total, self.total - self.other - self.on_disk(), BLOCK)

    def on_disk(self) -> int:
        return sum(-(-p.stat().st_size // BLOCK) * BLOCK for p in self.root.glob("*/*"))


def store_chain(store: DiskBackend, chain: Chain, batch: int = 4) -> list[bool]:
    acks: list[bool] = []
    for lo in range(0, len(chain.names), batch):
        acks += store.batch_set(chain.names[lo:lo + batch], chain.records[lo:lo + batch])
    return acks


def test_eviction_keeps_the_reserve_tail_first(tmp_path: Path) -> None:
    store = SharedDisk(tmp_path, layout_for(), 1 << 30, reserve=0.25)  # 10 of 40 records
    assert store._footprint(Chain(layout_for(), 1).records[0]) == RECORD
    a, b, c = (Chain(layout_for(), 12, seed=s) for s in range(3))
    for chain in (a, b, c):   # 36 records for room above the reserve of 30
        assert store_chain(store, chain) == [True] * 12
        assert store._filesystem().free >= 10 * RECORD
    # the least recently used chain lost its tail, and only that
    assert [store.batch_exists(x.names) for x in (a, b, c)] == [6, 12, 12]
    assert store.stats()["evicted/"] == 6 and "refused/disk_full" not in store.stats()
    assert store._filesystem().free == 10 * RECORD


def test_a_disk_filled_by_others_refuses_pages_as_disk_full(tmp_path: Path) -> None:
    store = SharedDisk(tmp_path, layout_for(), 1 << 30, reserve=4 * RECORD)
    a, d = Chain(layout_for(), 20, seed=1), Chain(layout_for(), 3, seed=4)
    assert store_chain(store, a) == [True] * 20
    store.other = 20 * RECORD   # another service writes: 20 + 20 + the reserve > 40
    assert store.batch_set(d.names, d.records) == [True] * 3   # a's tail made room
    assert store._filesystem().free == 4 * RECORD
    assert store.batch_exists(a.names) == 13
    store.other = 36 * RECORD   # now not even an empty store has room above the reserve
    e = Chain(layout_for(), 2, seed=5)
    assert store.batch_set(e.names, e.records) == [False, False]
    stats = store.stats()
    assert stats["refused/disk_full"] == 2 and "refused/storage_error" not in stats
    assert store.usage().records == 0 and store.on_disk() == 0   # every tail went first
    assert store.batch_get(e.names) == [None, None]
    assert store.stats()["miss/disk_full"] == 2   # a lookup says why it is not there
    store.other = 0
    assert store.batch_set(e.names, e.records) == [True, True]


def test_the_reserve_is_kept_at_start(tmp_path: Path) -> None:
    store = SharedDisk(tmp_path, layout_for(), 1 << 30, reserve=0.1)
    assert store_chain(store, Chain(layout_for(), 30)) == [True] * 30
    SharedDisk.other = 10 * RECORD   # the disk filled up while the store was down
    try:
        again = SharedDisk(tmp_path, layout_for(), 1 << 30, reserve=0.1)
    finally:
        SharedDisk.other = 0
    assert again.usage().records == 26 and again.stats()["evicted/"] == 4


def test_the_reserve_comes_from_the_config(tmp_path: Path) -> None:
    config = StorageConfig(backend="disk", disk_path=str(tmp_path), disk_reserve=1 << 20)
    assert make_backend(config, layout_for()).reserve == 1 << 20
    assert make_backend(StorageConfig(backend="disk", disk_path=str(tmp_path)),
                        layout_for()).reserve == 0.05
    with pytest.raises(ValueError, match="reserve"):
        DiskBackend(tmp_path, layout_for(), 1 << 20, reserve=2.5)


# -- a real filesystem ----------------------------------------------------------------------
BIG = layout_for(page_size=16, num_kv_heads=4, head_dim=64)   # 64 KiB a page


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of its own, unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_small_filesystem_keeps_its_reserve_and_counts_disk_full(small_fs: Path) -> None:
    reserve = 1 << 20
    store = DiskBackend(small_fs / "l3", BIG, 1 << 30, reserve=reserve)
    chains = [Chain(BIG, 40, seed=s) for s in range(3)]   # 7.5 MiB of records: 8 MiB fs
    for chain in chains:
        assert store_chain(store, chain, batch=8) == [True] * 40
        assert free_bytes(small_fs) >= reserve
    assert store.stats()["evicted/"] > 0 and "refused/disk_full" not in store.stats()
    assert store.batch_exists(chains[2].names) == 40   # the newest chain whole
    # the store is emptied and another writer takes all but half the reserve
    assert store.clear() > 0
    filler = small_fs / "other-service.bin"
    with open(filler, "wb") as f:
        while free_bytes(small_fs) > reserve // 2:
            f.write(b"\0" * min(1 << 20, free_bytes(small_fs) - reserve // 2))
    late = Chain(BIG, 2, seed=9)
    assert store.batch_set(late.names, late.records) == [False, False]
    assert store.stats()["refused/disk_full"] == 2
    # with no reserve the write itself fails (ENOSPC): still counted as disk_full
    bare = DiskBackend(small_fs / "l3b", BIG, 1 << 30, reserve=0)
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free_bytes(small_fs) - 4096))
    assert bare.batch_set(late.names, late.records) == [False, False]
    assert bare.stats()["refused/disk_full"] == 2
