"""The Serve deployment feeds every dashboard series too: real HTTP traffic through the app
(both prefill workers, a prefill worker restarted between two waves so that the second
finds its prompts in L3, write-through and offload), then a scrape of the Ray metrics port
over HTTP. Nothing is exported by the ingress: each worker and shard records its own."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pd_cache import ModelConfig
from pd_cache.cluster.operations import NAMESPACE
from pd_cache.metrics import RAY_PREFIX

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

from tests.integration.metrics_port import (  # noqa: E402
    missing_series,
    refuse_a_foreign_record,
    samples,
)
from tests.integration.serving import running_app  # noqa: E402  (needs ray[serve])

NAME, APP = "pd-cache-metrics", "pd-cache-metrics-app"
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 2, "num_decode": 1, "num_storage": 1,
        "device_pages": 64, "host_pages": 128, "metrics_interval_s": 0.5,
        "balance_threshold": 0, "cluster_name": NAME}
VOCAB = ModelConfig.preset("tiny").vocab_size


@pytest.fixture(scope="module")
def url(serve_url: str) -> Iterator[str]:
    from pd_cache import PDCluster

    try:
        with running_app(serve_url, ARGS, APP) as url:
            yield url
    finally:
        PDCluster.destroy(NAME)


def actor(role: str, i: int) -> Any:
    return ray.get_actor(f"{NAME}/{role}-{i}", namespace=NAMESPACE)


def worker_ids() -> set[str]:
    handles = [actor("prefill", 0), actor("prefill", 1), actor("decode", 0),
               actor("storage", 0)]
    return {ray.get(h.__ray_call__.remote(lambda _: ray.get_runtime_context().get_worker_id()))
            for h in handles}


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def wave(url: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: post(url, {"model": "tiny", "prompt": p,
                                                  "max_tokens": 6, "cache_salt": "m"}),
                             prompts))


def test_every_dashboard_series_is_fed_through_the_serve_app(url: str,
                                                             ray_cluster: Any) -> None:
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(26)] for _ in range(6)]
    first = wave(url, prompts)                         # both prefill workers compute
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for a in first)
    time.sleep(1.0)                                    # write-through lands in L3
    victim = ray.get(actor("prefill", 0).pid.remote())
    os.kill(victim, signal.SIGKILL)                    # comes back with empty L1/L2
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(actor("prefill", 0).pid.remote(), timeout=30) != victim:
                break
        except ray.exceptions.RayError:   # still dying or restarting
            pass
        assert time.monotonic() < deadline, "the prefill worker did not come back"
        time.sleep(0.5)
    again = wave(url, prompts)
    storage = sum(a["pd_cache"]["cached_tokens"]["storage"] for a in again)
    assert storage > 0, again                          # the restarted worker read L3
    assert refuse_a_foreign_record(actor("storage", 0)) == [[False]]   # refusals panel
    port = ray_cluster.metrics_port
    assert not missing_series(port, worker_ids())
    assert any(s.name == RAY_PREFIX + "pd_cache_prefetch_pages_total" for s in samples(port))
    shard = ray.get(actor("storage", 0).__ray_call__.remote(
        lambda _: ray.get_runtime_context().get_worker_id()))
    usage = ray.get(actor("storage", 0).usage.remote())
    deadline = time.monotonic() + 30
    while True:   # each shard reports its own bytes held and capacity
        gauges = {s.name: s.value for s in samples(port) if s.labels.get("WorkerId") == shard
                  and s.name.startswith(RAY_PREFIX + "pd_cache_storage_")
                  and s.name.endswith("_bytes")}
        if gauges.get(RAY_PREFIX + "pd_cache_storage_used_bytes", 0) > 0 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert gauges[RAY_PREFIX + "pd_cache_storage_capacity_bytes"] == usage.capacity_bytes
    assert 0 < gauges[RAY_PREFIX + "pd_cache_storage_used_bytes"] <= usage.capacity_bytes
