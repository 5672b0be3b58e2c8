"""The controller and the decode offload manager against StorageTier actors (L3 on Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.vocab import OFFLOAD, PREFETCH_ACK, PREFETCH_BATCH, SKIPPED, Event, MissReason
from pd_cache.storage.client import StorageClient
from pd_cache.storage.tier import storage_actors
from pd_cache.worker.engine import LocalEngine
from tests.integration.clusters import killed
from tests.unit.tiering.fakes import PS, assert_clean, config, prompt, reference

ray = pytest.importorskip("ray")


def conversation(cfg: Any, client: StorageClient) -> tuple[LocalEngine, Any, Any]:
    """Turn 1 on one engine (writes through and offloads), turn 2 on a fresh one."""
    first = LocalEngine(cfg, storage=client)
    turn1 = Req(rid="t1", input_ids=prompt(30, 26), cache_salt="tenant", max_new_tokens=12)
    first.generate(turn1)
    assert first.flush(30)
    first.close()
    turn2 = Req(rid="t2", input_ids=turn1.input_ids + turn1.output_ids + prompt(31, 7),
                cache_salt="tenant", max_new_tokens=5)
    return LocalEngine(cfg, storage=client, storage_timeout_s=5.0), turn1, turn2


def test_turn_two_loads_turn_one_from_tier_actors(ray_cluster: Any) -> None:
    cfg = config(batch=4, policy="wait_complete", num_shards=2)
    handles = storage_actors(cfg)
    try:
        client = StorageClient(handles, timeout_s=10.0)
        engine, _, turn2 = conversation(cfg, client)
        result = engine.generate(turn2)
        assert result.output_ids == reference(engine, turn2)
        # 26 + 12 - 1 tokens had KV in turn 1: 9 pages, prompt's 6 plus 3 of its answer
        assert result.cached_tokens["storage"] == 9 * PS
        # a get of the 11 pages past the (empty) local hit, no exists: the 3rd batch ends
        # where L3's copy does
        assert engine.stats.get(PREFETCH_BATCH) == 3
        assert engine.stats.get(PREFETCH_ACK, "ok") == 2
        assert engine.stats.get(PREFETCH_ACK, "short") == 1
        assert engine.flush(30)
        assert_clean(engine)
        engine.close()
    finally:
        for h in handles:
            ray.kill(h)


@pytest.mark.parametrize("min_pages, stored", [(2, 6), (1, 7)])
def test_offload_min_pages_decides_whether_a_lone_answer_page_is_sent(
        ray_cluster: Any, min_pages: int, stored: int) -> None:
    """24 prompt tokens (6 pages, one write-through call) and 5 new: decode's one write
    would send a single page (tokens 24-27). 2 makes no such call; 1 (the default) makes
    it. The next turn's output equals the no-cache model's either way."""
    cfg = config(batch=8, policy="wait_complete", offload_min_pages=min_pages)
    (handle,) = storage_actors(cfg)
    try:
        client = StorageClient([handle], timeout_s=10.0)
        engine = LocalEngine(cfg, storage=client)
        turn1 = Req(rid="t1", input_ids=prompt(40, 24), cache_salt="t", max_new_tokens=5)
        engine.generate(turn1)
        assert engine.flush(30)
        assert client.usage().records == stored
        assert ray.get(handle.calls.remote())["set"] == 1 + (stored == 7)
        assert engine.stats.get(OFFLOAD, SKIPPED) == (stored == 6)
        turn2 = Req(rid="t2", input_ids=turn1.input_ids + turn1.output_ids + prompt(41, 6),
                    cache_salt="t", max_new_tokens=4)
        fresh = LocalEngine(cfg, storage=client)
        result = fresh.generate(turn2)
        assert result.output_ids == reference(fresh, turn2)
        assert result.cached_tokens["storage"] == stored * PS
        for e in (engine, fresh):
            assert e.flush(30)
            assert_clean(e)
            e.close()
    finally:
        ray.kill(handle)


def test_a_dead_shard_falls_back_to_recompute(ray_cluster: Any) -> None:
    cfg = config(batch=4, policy="wait_complete", num_shards=2)
    handles = storage_actors(cfg, max_restarts=0, max_task_retries=0)
    owner = 1
    try:
        client = StorageClient(handles, timeout_s=5.0)
        engine, _, turn2 = conversation(cfg, client)
        names = compute_prefix_hash(turn2, turn2.input_ids, page_size=PS)
        owner = client.shards_of(names, [])[0]   # the chain's one segment lives there
        killed(handles[owner])
        result = engine.generate(turn2)
        assert result.output_ids == reference(engine, turn2)
        assert result.cached_tokens["storage"] < 9 * PS
        assert engine.stats.get(Event.MISS, MissReason.STORAGE_ERROR) > 0 or \
            client.stats().get("miss/storage_error", 0) > 0
        assert engine.stats.get(PREFETCH_ACK, "ok") + engine.stats.get(PREFETCH_ACK, "short") \
            == engine.stats.get(PREFETCH_BATCH)
        assert engine.flush(30)   # writes to the dead shard fail fast; none hangs
        assert_clean(engine)
        engine.close()
    finally:
        ray.kill(handles[1 - owner])
