"""Metrics of a real workload on a ``PDCluster`` (no Serve), scraped from the Ray metrics
port over HTTP.

A second turn served from L3 by the other prefill worker must show up as cached storage
tokens and prefetched pages; write-through and offload as written pages; a corrupted L3
record as a storage miss with reason ``verification_failed``. L3 is the ``disk`` backend,
so the corruption is a flipped byte in a record file and the shard itself finds it (the
tier exports its own counts to the metrics port). Every series the Grafana dashboard
queries must be exported, and still be after the storage actor restarts.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req
from pd_cache.model.model import Model, reference_generate
from tests.integration.metrics_port import missing_series, refuse_a_foreign_record, samples

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(num_prefill=2, num_decode=1, num_storage=1, model="tiny", page_size=PS,
                       device_pages=64, host_pages=128, storage_timeout_s=5.0,
                       metrics_interval_s=0.5)
VOCAB = CONFIG.pd_config.model.vocab_size
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any, disk: Path) -> Iterator[PDCluster]:
    c = PDCluster.start(dataclasses.replace(CONFIG, storage_backend="disk",
                                            disk_path=str(disk)))
    yield c
    c.shutdown(check=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def corrupt(disk: Path, names: list[bytes]) -> int:
    """Flip the last payload byte of each named record file in place (what a bad disk
    would do; the header still parses). Returns how many files it changed."""
    changed = 0
    for name in names:
        for path in disk.rglob(f"{name.hex()}.*.rec"):
            with path.open("r+b") as f:
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte ^ 0xFF]))
            changed += 1
    return changed


def worker_id(actor: Any) -> str:
    return ray.get(actor.__ray_call__.remote(
        lambda _: ray.get_runtime_context().get_worker_id()))


def scrape(port: int, name: str, label: tuple[str, str] | None, worker: str) -> float:
    """The sum of ``name`` over the samples of one process (and one label value)."""
    total = 0.0
    for s in samples(port):
        # NOTE: other tests share the cluster: count only the process we name.
        if (s.name == name and (label is None or s.labels.get(label[0]) == label[1])
                and s.labels.get("WorkerId") == worker):
            total += s.value
    return total


def poll(port: int, name: str, label: tuple[str, str] | None, worker: str,
         want: float) -> float:
    deadline = time.monotonic() + 30
    while True:
        got = scrape(port, name, label, worker)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_l3_reuse_and_a_corrupted_record_reach_the_metrics_port(cluster: PDCluster,
                                                                 ray_cluster: Any,
                                                                 disk: Path) -> None:
    model = Model(CONFIG.pd_config.model)

    def run(input_ids: list[int], worker: int) -> Any:
        req = Req(rid=f"m{random.random()}", input_ids=input_ids, cache_salt="tenant-m",
                  max_new_tokens=NEW_TOKENS)
        out = cluster.generate(req, prefill_worker=worker)
        ref = reference_generate(model, Req(rid="ref", input_ids=input_ids,
                                            max_new_tokens=NEW_TOKENS))
        assert out.output_ids == ref.output_ids
        cluster.flush()  # write-through and offload done before the next turn looks
        return out

    # Turn 1 on prefill 0; turn 2 on prefill 1, which has never seen it: L3 serves it.
    turn1 = tokens(1, 21)
    first = run(turn1, 0)
    second = run(turn1 + first.output_ids + tokens(2, 5), 1)
    assert second.cached_tokens["storage"] >= (len(turn1) // PS) * PS

    # A prompt stored by prefill 0, its records corrupted in L3, then asked for by prefill 1:
    # the reader refuses them (a miss), the worker recomputes, the output stays right.
    other = tokens(3, 16)
    run(other, 0)
    names = cluster.router_names(Req(rid="n", input_ids=other, cache_salt="tenant-m"))
    (tier,) = cluster.storage
    assert corrupt(disk, names) == len(names)
    again = run(other, 1)
    assert again.cached_tokens["storage"] == 0

    # Each process exports its own counts: they reach the port. Records are sealed, so the
    # reader (prefill 1) finds the damage when it opens them: every page it asked L3 for,
    # the prompt's reusable ones ((n - 1) // PS), counts as a verification failure there.
    port = ray_cluster.metrics_port
    storage_tokens = second.cached_tokens["storage"] + again.cached_tokens["storage"]
    got = poll(port, "ray_pd_cache_cached_tokens_total", ("tier", "storage"),
               worker_id(cluster.prefill[1]), storage_tokens)
    assert got == storage_tokens > 0
    failed = (len(other) - 1) // PS
    got = poll(port, "ray_pd_cache_storage_misses_total", ("reason", "verification_failed"),
               worker_id(cluster.prefill[1]), failed)
    assert got == failed > 0

    # Another model's page offered to the shard is refused, and counted by reason.
    assert refuse_a_foreign_record(tier) == [[False]]
    assert poll(port, "ray_pd_cache_storage_refusals_total", ("reason", "verification_failed"),
                worker_id(tier), 1) == 1

    # Every series the dashboard queries is exported by this cluster's processes, and the
    # counters equal what the workload counted, each in the process that did the work.
    workers = {worker_id(a) for a in [*cluster.prefill, *cluster.decode, tier]}
    assert not missing_series(port, workers)
    p1 = worker_id(cluster.prefill[1])
    assert poll(port, "ray_pd_cache_prefetch_pages_total", None, p1,
                storage_tokens // PS) == storage_tokens // PS
    # turn 2 read its pages; the corrupted prompt's read (a get, no exists first) found
    # nothing usable: no transfer, its pages the verification_failed misses above
    assert poll(port, "ray_pd_cache_prefetch_seconds_count", ("outcome", "ok"), p1,
                1) == 1
    for actor in [*cluster.prefill, *cluster.decode]:
        writes = sum(ray.get(actor.l3_writes.remote()).values())
        assert poll(port, "ray_pd_cache_backup_pages_total", ("outcome", "ok"),
                    worker_id(actor), writes) == writes
    (decode,) = cluster.decode
    stats, dw = ray.get(decode.engine_stats.remote()), worker_id(decode)
    for kind in ("prompt", "generated"):
        want = stats.get(f"offload/{kind}", 0)
        assert poll(port, "ray_pd_cache_offload_pages_total", ("page_kind", kind), dw,
                    want) == want
    assert stats["offload/generated"] > 0   # prompt pages: prefill wrote them through first
    requests = 4
    assert poll(port, "ray_pd_cache_inter_token_seconds_count", None, dw,
                requests * (NEW_TOKENS - 1)) == requests * (NEW_TOKENS - 1)
    assert poll(port, "ray_pd_cache_e2e_seconds_count", None, dw, requests) == requests
    assert poll(port, "ray_pd_cache_queue_seconds_count", None, dw, requests) == requests


def test_no_dashboard_series_goes_missing_across_a_storage_restart(cluster: PDCluster,
                                                                    ray_cluster: Any) -> None:
    (tier,) = cluster.storage
    before = ray.get(tier.ping.remote())
    ray.kill(tier, no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(tier.ping.remote(), timeout=10) != before:
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "the storage actor did not come back"
        time.sleep(0.5)
    # The restarted disk shard serves what it had stored; one more round of traffic.
    prompt = tokens(5, 18)
    for worker in (0, 1):
        req = Req(rid=f"r{worker}", input_ids=prompt, cache_salt="tenant-r",
                  max_new_tokens=NEW_TOKENS)
        cluster.generate(req, prefill_worker=worker)
        cluster.flush()
    assert refuse_a_foreign_record(tier) == [[False]]   # counted by the new process too
    workers = {worker_id(a) for a in [*cluster.prefill, *cluster.decode, tier]}
    assert not missing_series(ray_cluster.metrics_port, workers)
