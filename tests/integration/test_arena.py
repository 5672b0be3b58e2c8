"""A memory shard's arena on the session's Ray cluster: the test process (a Ray driver on
the shard's machine) writes through it as a worker does and reads back through it, bit
for bit; a set takes its slots from the lease an earlier grant call gave (no call);
slots freed by eviction are reused; a shard killed with SIGKILL is a clear miss, its
arena's mapping is dropped and writes go to the restarted shard's new arena."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.sealing import Keyring
from pd_cache.storage.arena import mapped
from pd_cache.storage.arena_backend import slot_bytes
from pd_cache.storage.arena_writer import ArenaWriter
from pd_cache.storage.base import ExtraInfo
from pd_cache.storage.client import StorageClient
from pd_cache.storage.seal import SealedStorage, Sealer
from pd_cache.storage.tier import storage_actor
from tests.unit.storage.records import Chain

ray = pytest.importorskip("ray")

PAGES = 6
TENANT = ExtraInfo(tenant="acme")


def config_for(slots: int) -> PDCacheConfig:
    layout = PDCacheConfig(model=ModelConfig.preset("tiny"), cache=CacheConfig(page_size=4))
    return PDCacheConfig(model=layout.model, cache=layout.cache, storage=StorageConfig(
        capacity_bytes=slots * slot_bytes(layout.layout), num_shards=1))


def restarted(handle: Any, old_pid: int, deadline_s: float = 60) -> int:
    """The shard's new process id, once Ray has restarted it (0: it did not)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            pid = ray.get(handle.ping.remote(), timeout=10)
            if pid != old_pid:
                return pid
        except ray.exceptions.RayError:
            time.sleep(0.2)
    return 0


def read_into(store: SealedStorage, chain: Chain) -> list[bool]:
    """The worker's read: each page opened into its own row; which ones came, equal."""
    rows = [torch.zeros_like(r.payload()) for r in chain.records]
    got = store.submit_get_into(chain.names, rows, TENANT).result()
    return [g is not None and g.payload().data_ptr() == row.data_ptr()
            and torch.equal(row.view(torch.uint8), want.payload().view(torch.uint8))
            for g, row, want in zip(got, rows, chain.records)]


def test_sealed_pages_go_through_the_arena_and_a_killed_shard_is_a_clean_miss(
        ray_cluster: Any) -> None:
    config = config_for(slots=2 * PAGES)
    handle = storage_actor(config, max_restarts=1)
    client = StorageClient([handle], timeout_s=20, layout=config.layout)
    store = SealedStorage(client, Sealer(Keyring.random()), scratch_bytes=1 << 20,
                          arena=ArenaWriter(client))
    try:
        pid = ray.get(handle.ping.remote())
        first = Chain(config.layout, PAGES, seed=1)
        assert store.batch_set(first.names, first.records, TENANT) == [True] * PAGES
        usage = ray.get(handle.arena_usage.remote())
        # adopted, not copied; the grant call leased the other free slots ahead
        assert (usage["live"], usage["granted"], usage["grant_calls"]) == (PAGES, PAGES, 1)
        assert usage["id"] in {info.id for info in mapped()}
        assert read_into(store, first) == [True] * PAGES
        # two more chains: the second takes the lease (no call); the third calls, and the
        # first one is evicted and its slots are taken again
        for seed in (2, 3):
            chain = Chain(config.layout, PAGES, seed=seed)
            assert store.batch_set(chain.names, chain.records, TENANT) == [True] * PAGES
        usage = ray.get(handle.arena_usage.remote())
        assert (usage["live"], usage["free"], usage["granted"]) == (2 * PAGES, 0, 0)
        assert usage["grant_calls"] == 2
        assert read_into(store, chain) == [True] * PAGES
        assert store.batch_get(first.names, TENANT) == [None] * PAGES

        os.kill(pid, signal.SIGKILL)
        assert restarted(handle, pid)
        # the restarted shard is empty: a clear miss, never the dead arena's bytes
        assert read_into(store, chain) == [False] * PAGES
        assert client.stats()["miss/not_stored"] >= PAGES
        again = Chain(config.layout, PAGES, seed=4)
        assert store.batch_set(again.names, again.records, TENANT) == [True] * PAGES
        fresh = ray.get(handle.arena_usage.remote())
        assert fresh["live"] == PAGES and fresh["id"] != usage["id"]
        assert (fresh["granted"], fresh["grant_calls"]) == (PAGES, 1)   # a new lease
        assert {info.id for info in mapped()} & {usage["id"], fresh["id"]} == {fresh["id"]}
        assert read_into(store, again) == [True] * PAGES
    finally:
        ray.kill(handle)
