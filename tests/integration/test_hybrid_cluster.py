"""A hybrid model (tiny-hybrid) on the PD cluster and over real StorageTier actors: KV and
the recurrent state move through every tier; the output equals the no-cache model's."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from pd_cache.app.bench.workloads import multi_turn_workload
from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req
from pd_cache.core.vocab import STATE
from pd_cache.model.model import Model
from pd_cache.storage.client import StorageClient
from pd_cache.storage.tier import storage_actors
from pd_cache.worker.engine import LocalEngine
from tests.integration import clusters
from tests.integration.clusters import (
    check_answers,
    closed_loop,
    expected,
    request,
    stream_killing_decode,
    wait_healthy,
)
from tests.unit.tiering.fakes import Recorder
from tests.unit.tiering.hybrid_calls import NAMES, WRITE_RUNS, P, check_calls
from tests.unit.tiering.hybrid_calls import config as calls_config

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(model="tiny-hybrid", page_size=PS, device_pages=64, host_pages=128,
                       storage_timeout_s=5.0)
VOCAB = CONFIG.pd_config.model.vocab_size


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Iterator[PDCluster]:
    c = PDCluster.start(CONFIG)
    yield c
    c.shutdown(check=True)  # raises if any worker leaked a lock, a page or a state slot


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CONFIG.pd_config.model)


def req(ids: list[int], ns: tuple[str | None, str | None] = (None, None),
        max_new: int = 5) -> Req:
    return request(ids, ns, max_new, prefix="h")


def tokens(seed: int, n: int) -> list[int]:
    return clusters.tokens(seed, n, VOCAB)


def assert_idle(cluster: PDCluster) -> None:
    clusters.assert_idle(cluster, pools={"state"})   # the hybrid state pool is reported


def test_multi_turn_multi_tenant_output_equals_reference(cluster: PDCluster,
                                                          model: Model) -> None:
    wl = multi_turn_workload(2, 2, 3, system_tokens=22, user_tokens=7, output_tokens=6,
                             vocab_size=VOCAB, seed=5)
    run = closed_loop(cluster, wl, lockstep=True)
    check_answers(model, wl, run)
    assert sum(r.cached_tokens for r in run.records) > 0
    # decode's prefix cache served turns 2 and 3 (reserved, seam checked, never refilled)
    stats = [s for w, s in cluster.engine_stats().items() if w.startswith("decode")]
    assert sum(s.get("keep/kept", 0) for s in stats) > 0
    assert not any(s.get("keep/lost") or s.get("keep/seam_mismatch") for s in stats)
    assert_idle(cluster)


def test_turn_two_on_the_other_worker_resumes_from_l3(cluster: PDCluster,
                                                      model: Model) -> None:
    ns = ("lora-h", "tenant-h")
    turn1 = req(tokens(1, 21), ns, max_new=10)
    out1 = cluster.generate(turn1, prefill_worker=0)
    cluster.flush()
    writes = cluster.engine_stats()
    assert sum(s.get(f"backup/{STATE}", 0) for s in writes.values()) >= 1
    assert sum(s.get(f"offload/{STATE}", 0) for s in writes.values()) >= 1
    turn2 = req(turn1.input_ids + out1.output_ids + tokens(2, 6), ns, max_new=4)
    out2 = cluster.generate(turn2, prefill_worker=1)
    assert out2.output_ids == expected(model, turn2)
    # the prompt's pages (write-through) and the answer's (offload, whose last write ends
    # with a state): every page whose tokens all have KV after turn 1
    assert out2.cached_tokens["storage"] == PS * ((21 + 10 - 1) // PS)
    assert out2.cached_tokens["device"] == out2.cached_tokens["host"] == 0
    other = cluster.generate(req(turn2.input_ids, (None, "tenant-other"), 4),
                             prefill_worker=1)
    assert other.output_ids == expected(model, turn2)
    assert sum(other.cached_tokens.values()) == 0          # namespaces stay apart
    assert_idle(cluster)


def test_the_tier_actors_receive_kv_and_trailing_state_with_the_operations_prefix(
        ray_cluster: Any, model: Model) -> None:
    cfg = calls_config(prefix_keys=True)
    cfg = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, num_shards=2))
    handles = storage_actors(cfg)
    try:
        store = Recorder(StorageClient(handles, timeout_s=10.0))
        writer = LocalEngine(cfg, storage=store, storage_timeout_s=10.0)
        r = Req(rid="w", input_ids=P, cache_salt="t", max_new_tokens=1)
        writer.prefill(r)
        assert writer.flush(30)
        check_calls(store.calls, "set", WRITE_RUNS, "w", True)
        writer.close()
        reader = LocalEngine(cfg, storage=store, storage_timeout_s=10.0)
        again = Req(rid="r", input_ids=P, cache_salt="t", max_new_tokens=6)
        out = reader.generate(again)
        assert out.output_ids == expected(model, again)
        assert out.cached_tokens["storage"] == len(NAMES) * PS
        check_calls(store.calls, "get", WRITE_RUNS, "r", True)
        assert reader.flush(30)
        reader.close()
    finally:
        for h in handles:
            ray.kill(h)


def test_a_hybrid_stream_resumes_after_its_decode_worker_is_killed(cluster: PDCluster,
                                                                   model: Model) -> None:
    """kill -9 of the decode worker mid-stream on the hybrid model: the resumed prefill
    rebuilds the recurrent state from prompt + the tokens sent, and the answer is the one
    an unbroken run gives; the worker comes back."""
    r = req(tokens(61, 29), (None, "tenant-resume"), max_new=300)
    sent, out, worker, pid = stream_killing_decode(cluster, r, after=5)
    assert sent == out.output_ids == expected(model, r)
    assert out.attempts == 2 and out.decode_worker != worker
    wait_healthy(cluster, "decode", worker)
    assert ray.get(cluster.decode[worker].pid.remote()) != pid
    cluster.flush()
    assert_idle(cluster)
