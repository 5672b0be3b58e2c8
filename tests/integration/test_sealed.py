"""Sealed L3 on a real cluster (1 prefill, 1 decode, 1 disk shard): the files give no prompt
back, a key rotation keeps old records readable until retired, a purge forgets one tenant
in every tier while another keeps its pages, a tenant over its L3 quota evicts only its own
pages (the shard knows it by owner label), and a worker killed with SIGKILL comes back with
the cluster's keys."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req
from pd_cache.model.digest import with_weights_digest
from pd_cache.model.model import Model
from tests.integration import clusters
from tests.integration.clusters import assert_idle, expected
from tests.unit.storage.recovery import recover, stolen_records, vocabulary_v_rows

ray = pytest.importorskip("ray")

PS = 4
CAPACITY = 160_000   # L3 bytes: about 60 pages of the tiny model


@pytest.fixture(scope="module")
def disk_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sealed-l3")


@pytest.fixture(scope="module")
def config(disk_path: Path) -> ClusterConfig:
    return ClusterConfig(model="tiny", page_size=PS, device_pages=64, host_pages=64,
                         num_prefill=1, num_decode=1, num_storage=1, storage_backend="disk",
                         disk_path=str(disk_path), storage_timeout_s=5.0,
                         storage_capacity_bytes=CAPACITY)


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any, config: ClusterConfig) -> Iterator[PDCluster]:
    c = PDCluster.start(config)
    yield c
    c.shutdown(check=True)  # raises if any worker leaked a lock or a slot


def ask(cluster: PDCluster, model: Model, tenant: str, prompt: list[int]) -> dict[str, int]:
    """``prompt`` as ``tenant`` (its own namespace, as the server would give it): the
    answer is the no-cache one; the prompt tokens each tier served."""
    req = clusters.request(prompt, (None, f"salt-{tenant}"))
    req = Req(rid=req.rid, input_ids=prompt, cache_salt=req.cache_salt, max_new_tokens=3,
              tenant=tenant)
    out = cluster.generate(req)
    assert out.output_ids == expected(model, req)
    cluster.flush()
    return out.cached_tokens


def forget_workers(cluster: PDCluster) -> None:
    """Empty the workers' L1 and L2 only: what comes next is read from L3."""
    ray.get([a.drop_cache.remote() for a in cluster.prefill + cluster.decode])


def test_sealed_l3_rotation_retirement_and_purge(cluster: PDCluster, config: ClusterConfig,
                                                  disk_path: Path, tmp_path: Path) -> None:
    pd = with_weights_digest(config.pd_config)   # the layout the shard files records under
    model = Model(pd.model)
    vocab = pd.model.vocab_size
    acme, beta = clusters.tokens(1, 10 * PS + 1, vocab), clusters.tokens(2, 6 * PS + 1, vocab)
    assert sum(ask(cluster, model, "acme", acme).values()) == 0
    assert sum(ask(cluster, model, "beta", beta).values()) == 0

    # The review's attack on the store's files recovers no token of either prompt.
    stolen = stolen_records(disk_path, tmp_path / "copy", pd.layout)
    assert len(stolen) >= 16
    table, dtype = vocabulary_v_rows(model), model.kv_dtype
    found = [t for rec in stolen for t in recover(rec.payload(), table,
                                                  pd.layout.page_shape, dtype)]
    assert found and all(t is None for t in found)

    # A rotation: new writes use version 2; version 1 records still serve hits.
    assert cluster.rotate_keys().version == 2
    forget_workers(cluster)
    assert ask(cluster, model, "acme", acme)["storage"] == 10 * PS
    # Retired: version 1 records are misses and the shard deletes them.
    assert cluster.retire_keys().wait(timeout=30) >= 10
    forget_workers(cluster)
    assert ask(cluster, model, "acme", acme)["storage"] == 0   # recomputed, stored again
    assert ask(cluster, model, "beta", beta)["storage"] == 0

    # A purge: acme is forgotten in every tier at once; beta keeps its pages.
    owner = ray.get(cluster.prefill[0].owner.remote("acme"))
    purge = cluster.purge_tenant("acme")
    assert purge.pages >= 10 and purge.wait(timeout=30) == 10
    files = stolen_records(disk_path, tmp_path / "after", pd.layout)
    assert files and all(r.header.seal.owner != owner for r in files)   # none of acme's
    assert sum(ask(cluster, model, "acme", acme).values()) == 0
    assert ask(cluster, model, "beta", beta)["device"] == 6 * PS
    forget_workers(cluster)
    assert ask(cluster, model, "beta", beta)["storage"] == 6 * PS
    assert_idle(cluster)


def test_a_noisy_tenant_over_its_quota_cannot_evict_a_quiet_one(cluster: PDCluster,
                                                                 config: ClusterConfig) -> None:
    pd = with_weights_digest(config.pd_config)
    model, vocab = Model(pd.model), pd.model.vocab_size
    (shard,) = cluster.storage
    cluster.drop_caches()
    quiet = clusters.tokens(3, 8 * PS + 1, vocab)
    assert sum(ask(cluster, model, "quiet", quiet).values()) == 0
    usage = ray.get(shard.usage.remote())
    page = usage.bytes // usage.records   # one sealed page's file (all are the same size)
    quota = 6 * page
    cluster.set_quotas({"noisy": quota})
    # noisy sends unique prompts: twice the shard's capacity (it would take every page
    # without a quota); its bytes never pass its quota, quiet keeps every page in L3
    floods = 2 * CAPACITY // (8 * page) + 1
    most = 0
    for i in range(floods):
        ask(cluster, model, "noisy", clusters.tokens(100 + i, 8 * PS + 1, vocab))
        most = max(most, cluster.tenant_l3_bytes(["noisy"])["noisy"])
    assert quota - page <= most <= quota
    assert ray.get(shard.stats.remote())["refused/quota"] > 0
    forget_workers(cluster)
    assert ask(cluster, model, "quiet", quiet)["storage"] == 8 * PS
    held = cluster.tenant_l3_bytes(["quiet", "noisy"])
    assert held["quiet"] >= 8 * page and held["noisy"] <= quota
    cluster.set_quotas({})
    assert_idle(cluster)


def test_a_restarted_worker_comes_back_with_the_cluster_keys(cluster: PDCluster,
                                                              config: ClusterConfig) -> None:
    """kill -9 of the prefill worker after a rotation: the new process has the cluster's key
    state, not the one it was started with; it reads the records written before its restart
    under both still-valid versions, and those of a version retired since are misses."""
    pd = with_weights_digest(config.pd_config)
    model, vocab = Model(pd.model), pd.model.vocab_size
    old, new = clusters.tokens(3, 5 * PS + 1, vocab), clusters.tokens(4, 4 * PS + 1, vocab)
    assert sum(ask(cluster, model, "gamma", old).values()) == 0   # sealed under version v
    rotated = cluster.rotate_keys()
    assert sum(ask(cluster, model, "gamma", new).values()) == 0   # under v + 1
    pid = ray.get(cluster.prefill[0].pid.remote())
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 30
    while (now := _pid(cluster)) in (None, pid) and time.monotonic() < end:
        time.sleep(0.2)
    assert now not in (None, pid)
    assert ray.get(cluster.prefill[0].__ray_call__.remote(
        lambda worker: worker.keyring.state)) == rotated
    forget_workers(cluster)   # the decode worker's pages too: what follows comes from L3
    assert ask(cluster, model, "gamma", old)["storage"] == 5 * PS
    assert ask(cluster, model, "gamma", new)["storage"] == 4 * PS
    assert cluster.retire_keys().wait(timeout=30) >= 5
    forget_workers(cluster)
    assert ask(cluster, model, "gamma", old)["storage"] == 0
    assert ask(cluster, model, "gamma", new)["storage"] == 4 * PS
    assert_idle(cluster)


def _pid(cluster: PDCluster) -> int | None:
    try:
        return ray.get(cluster.prefill[0].pid.remote(), timeout=5)
    except ray.exceptions.RayError:
        return None
