"""The Serve app survives crashes: a decode worker killed with SIGKILL under HTTP load, and
the ingress replica itself killed (it restarts and reattaches to the same named cluster
instead of starting a second one). Real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pd_cache import ModelConfig, PDCluster, Req, reference_generate
from pd_cache.cluster.operations import NAMESPACE
from pd_cache.model.model import Model

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

from tests.integration.serving import running_app  # noqa: E402  (needs ray[serve])

NAME = "pd-cache-faults"
APP = "pd-cache-faults-app"
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 2, "num_decode": 2, "num_storage": 1,
        "device_pages": 64, "host_pages": 128, "request_timeout_s": 30.0,
        "cluster_name": NAME}
MODEL = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def url(ray_cluster: Any) -> Iterator[str]:
    try:
        with running_app(ARGS, APP) as url:
            yield url
    finally:
        assert PDCluster.destroy(NAME) == 5   # the named actors outlived the replica


def call(url: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                      headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except (urllib.error.URLError, ConnectionError) as err:
        return 0, {"error": str(err)}


def pid_of(role: str, i: int) -> int:
    return ray.get(ray.get_actor(f"{NAME}/{role}-{i}", namespace=NAMESPACE).pid.remote())


def wait_for(url: str, ok: Any, timeout_s: float = 60) -> dict[str, Any]:
    """A bounded poll of /healthz until ``ok(status, body)``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        status, body = call(url + "/healthz")
        if ok(status, body):
            return body
        time.sleep(0.25)
    raise AssertionError(f"/healthz never got there: {status} {body}")


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(MODEL.vocab_size) for _ in range(14 + i % 5)] for i in range(n)]


def reference(model: Model, input_ids: list[int], max_new: int) -> list[int]:
    return reference_generate(model, Req(rid="ref", input_ids=input_ids,
                                         max_new_tokens=max_new)).output_ids


def test_a_decode_worker_killed_under_http_load_costs_no_request(url: str) -> None:
    model = Model(MODEL)
    wait_for(url, lambda status, body: status == 200)
    victim = pid_of("decode", 0)
    batch = prompts(1, 24)

    def one(p: list[int]) -> tuple[int, dict[str, Any]]:
        return call(url + "/v1/generate", {"input_ids": p, "max_new_tokens": 40,
                                           "cache_salt": "tenant-k"})

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, p) for p in batch]
        while not any(f.done() for f in futures):
            time.sleep(0.02)
        in_flight = sum(not f.done() for f in futures)
        os.kill(victim, signal.SIGKILL)
        answers = [f.result(timeout=120) for f in futures]
    assert in_flight > 0
    for p, (status, body) in zip(batch, answers):
        assert status == 200, body
        assert body["output_ids"] == reference(model, p, 40)
    body = wait_for(url, lambda status, body: status == 200 and 0 in body["live"]["decode"])
    assert body["live"]["prefill"] == [0, 1]
    assert pid_of("decode", 0) != victim


def test_a_killed_ingress_restarts_and_reattaches_to_the_same_workers(url: str) -> None:
    workers = {(r, i): pid_of(r, i) for r in ("prefill", "decode") for i in range(2)}
    from ray._private import state

    replicas = [info["Pid"] for info in state.actors().values()
                if info["ActorClassName"].endswith(f"{APP}:PDCacheIngress")
                and info["State"] == "ALIVE"]
    assert len(replicas) == 1
    os.kill(replicas[0], signal.SIGKILL)
    time.sleep(0.5)
    wait_for(url, lambda status, body: status == 200, timeout_s=90)
    status, body = call(url + "/v1/generate", {"input_ids": prompts(2, 1)[0],
                                               "max_new_tokens": 4})
    assert status == 200, body
    assert {(r, i): pid_of(r, i) for r in ("prefill", "decode") for i in range(2)} == workers
    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith(f"{NAME}/")]
    assert len(named) == 5                                  # no second cluster was started
    # The replica that created the workers is gone: a worker killed now still restarts.
    victim = workers[("prefill", 1)]
    os.kill(victim, signal.SIGKILL)
    wait_for(url, lambda status, body: status == 200 and 1 in body["live"]["prefill"])
    assert pid_of("prefill", 1) != victim
    status, body = call(url + "/v1/generate", {"input_ids": prompts(3, 1)[0],
                                               "max_new_tokens": 4})
    assert status == 200, body
