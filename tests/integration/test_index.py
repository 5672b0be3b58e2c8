"""The cluster page index on a real PD cluster: KV events from every worker and L3 shard,
routing from it shared by two fronts (prefill, and decode to the worker keeping a prefix),
and its faults (the index killed under load, a worker restarted); a front routing from its
own mirror of the index, with no query, through the index's kill.

Central checks: every answer is the no-cache model's, no request fails, and every slot and
lock is back with the cache once a scenario ends.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from pd_cache import ClusterConfig, PDCluster, Req
from pd_cache.core.events import IndexAnswer
from pd_cache.model.model import Model
from tests.integration.clusters import assert_idle, expected, started, wait_healthy

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(num_prefill=2, num_decode=2, num_storage=1, model="tiny", page_size=PS,
                       device_pages=64, host_pages=128, storage_timeout_s=5.0,
                       index_shards=1, index_timeout_s=0.5, index_mirror_s=0)   # asks it
MIRRORED = replace(CONFIG, index_mirror_s=2.0)
VOCAB = CONFIG.pd_config.model.vocab_size


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Iterator[PDCluster]:
    yield from started(CONFIG)


def prompt_reqs(seed: int, n: int, system: int = 32, own: int = 9) -> list[Req]:
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(system)]
    return [Req(rid=f"i{seed}-{i}", input_ids=head + [rng.randrange(VOCAB) for _ in range(own)],
                cache_salt="t", max_new_tokens=4) for i in range(n)]


def until(check: Any, what: str, timeout_s: float = 20.0) -> Any:
    """A bounded poll: ``check()`` until it returns something true."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def answered(method: Any) -> Any:
    """The actor's answer, ``None`` while it restarts."""
    try:
        return ray.get(method.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def lookup(front: PDCluster, req: Req) -> IndexAnswer | None:
    assert front.index is not None
    return asyncio.run(front.index.lookup(front.router_names(req)))


def killed_under_load(front: PDCluster, reqs: list[Req], early: int, pid: int) -> list[Any]:
    """``reqs`` through ``front``, all at once; ``pid`` (the index) kill -9'd once the first
    ``early`` are under way. Their completions."""
    async def run() -> list[Any]:
        first = [asyncio.ensure_future(front.generate_async(r)) for r in reqs[:early]]
        await asyncio.sleep(0)
        os.kill(pid, signal.SIGKILL)
        late = [asyncio.ensure_future(front.generate_async(r)) for r in reqs[early:]]
        return await asyncio.wait_for(asyncio.gather(*first, *late), 120)

    return asyncio.run(run())


def test_index_routes_two_fronts_alike_survives_its_kill_and_drops_a_restarted_worker(
        cluster: PDCluster) -> None:
    model = Model(CONFIG.pd_config.model)
    first = prompt_reqs(1, 1)[0]
    full = len(first.input_ids) // PS
    assert cluster.generate(first, prefill_worker=1).output_ids == expected(model, first)
    cluster.flush()
    # 1. every tier's events arrive: prefill-1 holds the prompt on device, L3 all of it
    seen = until(lambda: (a := lookup(cluster, first)) and a.l3_pages == full
                 and a.workers.get("prefill-1", None) and a, "the index learns the prompt")
    assert seen.workers["prefill-1"].device == full
    assert seen.workers.get("decode-0") and "prefill-0" not in seen.workers
    # 2. a second front, no hints of its own, routes a request of that prefix to worker 1
    second = PDCluster(CONFIG, cluster.prefill, cluster.decode, cluster.storage,
                       cluster.index_actors)
    follow = prompt_reqs(1, 2)[1]
    assert second.prefill_router.pick(second.router_names(follow)).worker == 0   # hints alone
    out = second.generate(follow)
    assert out.prefill_worker == 1 and out.cached_tokens["device"] >= 32
    assert out.output_ids == expected(model, follow) and second.routed["index"] == 1
    # 3. kill -9 the index under load: routing falls back, nothing fails, it is rebuilt
    victim = cluster.index_actors[0]
    pid = ray.get(victim.pid.remote())
    reqs = prompt_reqs(2, 8) + prompt_reqs(3, 16)
    hints = cluster.routed["hints"]
    outs = killed_under_load(cluster, reqs, 8, pid)
    assert [o.output_ids for o in outs] == [expected(model, r) for r in reqs]
    assert cluster.routed["hints"] > hints                          # fell back meanwhile
    until(lambda: answered(victim.pid) not in (None, pid), "a new index process")
    until(lambda: (a := lookup(cluster, first)) and a.l3_pages == full
          and a.workers.get("prefill-1") and a.workers.get("decode-0"),
          "the index rebuilt from snapshots")
    # NOTE: each publisher comes back on its own next flush (a heartbeat when it is idle)
    every = {"prefill-0", "prefill-1", "decode-0", "storage-0"}
    until(lambda: every <= set(ray.get(victim.stats.remote())["publishers"]),
          "every publisher known to the new index")
    # 4. a restarted worker's entries go with its old epoch
    worker_pid = ray.get(cluster.prefill[1].pid.remote())
    os.kill(worker_pid, signal.SIGKILL)
    wait_healthy(cluster, "prefill", 1)
    until(lambda: (a := lookup(cluster, first)) and "prefill-1" not in a.workers
          and a.l3_pages == full, "prefill-1's old entries dropped")
    cluster.flush()
    assert_idle(cluster)


def test_a_front_with_no_hints_decodes_where_the_index_says_the_prefix_is_kept(
        cluster: PDCluster) -> None:
    model = Model(CONFIG.pd_config.model)
    first = prompt_reqs(5, 1)[0]
    out = cluster.generate(first, decode_worker=1)      # decode-1 keeps prompt and answer
    assert out.output_ids == expected(model, first)
    rng = random.Random(6)
    turn = Req(rid="i5-turn", input_ids=first.input_ids + out.output_ids
               + [rng.randrange(VOCAB) for _ in range(7)], cache_salt="t", max_new_tokens=4)
    kept = len(first.input_ids) // PS                   # at least its prompt's full pages
    until(lambda: (a := lookup(cluster, turn)) and (hit := a.workers.get("decode-1"))
          and hit.pages >= kept, "the index learns what decode-1 keeps")
    second = PDCluster(CONFIG, cluster.prefill, cluster.decode, cluster.storage,
                       cluster.index_actors)
    names = second.router_names(turn)
    assert second.decode_router.pick(names) == (0, 0)   # its hints alone: by load
    done = second.generate(turn)
    assert done.decode_worker == 1 and done.pages_kept >= kept
    assert done.output_ids == expected(model, turn) and second.routed["index"] == 1
    cluster.flush()
    assert_idle(cluster)


def test_a_front_routes_from_its_mirror_with_no_query_and_resyncs_after_the_index_is_killed(
        cluster: PDCluster) -> None:
    model = Model(CONFIG.pd_config.model)
    front = PDCluster(MIRRORED, cluster.prefill, cluster.decode, cluster.storage,
                      cluster.index_actors)
    assert front.mirror is not None
    try:
        mirrored_front(cluster, front, model)
    finally:
        front.mirror.stop()   # its thread stops before Ray does
    cluster.flush()
    assert_idle(cluster)


def mirrored_front(cluster: PDCluster, front: PDCluster, model: Model) -> None:
    assert front.mirror is not None
    first, follow = prompt_reqs(8, 2)
    assert cluster.generate(first, prefill_worker=1).output_ids == expected(model, first)
    cluster.flush()
    names = front.router_names(first)
    until(lambda: (a := front.mirror.answer(names)) and a.workers.get("prefill-1"),
          "the mirror learns the prompt")
    shard = cluster.index_actors[0]
    queries, answered = ray.get(shard.stats.remote()).get("query", 0), front.mirror.counts[
        "answered"]
    out = front.generate(follow)                     # no hints of its own: the mirror's
    assert out.prefill_worker == 1 and out.cached_tokens["device"] >= 32
    assert out.output_ids == expected(model, follow)
    assert ray.get(shard.stats.remote()).get("query", 0) == queries   # no query on its path
    assert front.routed["index"] == 1 and front.mirror.counts["answered"] == answered + 1
    # kill -9 the index under load: the mirror, then the index, then the hints; 0 fail
    epoch, pid = front.mirror.copies[0].epoch, ray.get(shard.pid.remote())
    reqs = prompt_reqs(9, 6) + prompt_reqs(10, 10)
    outs = killed_under_load(front, reqs, 6, pid)
    assert [o.output_ids for o in outs] == [expected(model, r) for r in reqs]
    # the mirror resyncs: the new process's epoch, its entries rebuilt from snapshots
    until(lambda: (a := front.mirror.answer(names)) and a.workers.get("prefill-1")
          and front.mirror.copies[0].epoch != epoch, "the mirror resynced", 30)
    stats = front.mirror.stats()
    assert stats["failed"] >= 1 and stats["snapshot"] >= 2, stats
    queries = ray.get(shard.stats.remote()).get("query", 0)
    again = front.generate(prompt_reqs(8, 3)[2])
    assert again.prefill_worker == 1 and again.output_ids == expected(model, prompt_reqs(8, 3)[2])
    assert ray.get(shard.stats.remote()).get("query", 0) == queries
