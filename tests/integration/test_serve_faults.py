"""The Serve app survives crashes and clients that leave: a decode worker killed with
SIGKILL under HTTP load; one of two ingress replicas killed under load (the other serves;
the dead one restarts and reattaches to the same named cluster instead of starting a second
one); clients that hang up (their requests leave the workers). Real HTTP on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from pd_cache import ModelConfig, PDCluster, Req, reference_generate
from pd_cache.cluster.operations import NAMESPACE
from pd_cache.model.model import Model

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

from tests.integration.clusters import assert_idle  # noqa: E402
from tests.integration.serving import DIRECT_INGRESS, running_app  # noqa: E402

NAME = "pd-cache-faults"
APP = "pd-cache-faults-app"
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 2, "num_decode": 2, "num_storage": 1,
        "device_pages": 64, "host_pages": 128, "request_timeout_s": 30.0,
        "cluster_name": NAME, "ingress_replicas": 1 if DIRECT_INGRESS else 2}
MODEL = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def url(serve_url: str) -> Iterator[str]:
    try:
        with running_app(serve_url, ARGS, APP) as url:
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
        raw = err.read()
        try:
            return err.code, json.loads(raw or b"{}")
        except ValueError:   # Serve's proxy answers a dead replica's requests in plain text
            return err.code, {"text": raw.decode("utf-8", "replace")}
    except (urllib.error.URLError, ConnectionError) as err:
        return 0, {"error": str(err)}


def worker(role: str, i: int) -> Any:
    return ray.get_actor(f"{NAME}/{role}-{i}", namespace=NAMESPACE)


def pid_of(role: str, i: int) -> int:
    return ray.get(worker(role, i).pid.remote())


WORKERS = SimpleNamespace(states=lambda: ray.get(
    [worker(r, i).state.remote() for r in ("prefill", "decode") for i in range(2)]))


def idle() -> bool:
    try:
        assert_idle(WORKERS)
    except AssertionError:
        return False
    return True


def until(what: str, done: Callable[[], Any], timeout_s: float = 60) -> Any:
    """A bounded poll of ``done()`` until it is truthy."""
    end = time.monotonic() + timeout_s
    while not (answer := done()):
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.05)
    return answer


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


def held_by_decode(prefix: str) -> set[str]:
    """The client rids starting with ``prefix`` that a decode worker holds (its batch or
    its queue; the internal rid is the client's + ``#`` + a random tag)."""
    states = ray.get([worker("decode", i).state.remote() for i in range(2)])
    return {rid.split("#")[0] for s in states for rid in s.requests if rid.startswith(prefix)}


def cancelled() -> int:
    stats = ray.get([worker("decode", i).engine_stats.remote() for i in range(2)])
    return sum(s.get("deadline/cancelled", 0) for s in stats)


def test_clients_that_hang_up_leave_no_request_on_the_workers(url: str) -> None:
    wait_for(url, lambda status, body: status == 200)
    before, parts = cancelled(), urllib.parse.urlsplit(url)
    clients = []
    for i, p in enumerate(prompts(4, 6)):   # completions and chats, none streaming
        chat = i % 3 == 2
        body = {"model": "tiny", "max_tokens": 900, "ignore_eos": True, "rid": f"gone-{i}",
                **({"messages": [{"role": "user", "content": f"hello {i}"}]} if chat else
                   {"prompt": p})}
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions",
                     json.dumps(body), {"Content-Type": "application/json"})
        clients.append(conn)
    every = {f"gone-{i}" for i in range(6)}
    until("every request decoding", lambda: held_by_decode("gone-") == every)
    for conn in clients:   # they hang up without reading an answer
        conn.close()
    # Once the workers have stepped, the batches hold none of them: each was dropped (not
    # finished: 900 tokens take far more steps), and nothing it held is left.
    until("the batches let them go", lambda: not held_by_decode("gone-"))
    assert cancelled() - before == 6
    until("no lock or slot left", idle)
    assert_idle(WORKERS)


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


def ingress_pids() -> list[int]:
    from ray._private import state

    return [info["Pid"] for info in state.actors().values()
            if info["ActorClassName"].endswith(f"{APP}:PDCacheIngress")
            and info["State"] == "ALIVE"]


@pytest.mark.skipif(DIRECT_INGRESS, reason="direct ingress: one port takes one replica")
def test_one_of_two_ingress_replicas_killed_under_load_costs_no_later_request(url: str) -> None:
    workers = {(r, i): pid_of(r, i) for r in ("prefill", "decode") for i in range(2)}
    replicas = until("two ingress replicas", lambda: (p := ingress_pids()) and len(p) == 2 and p)
    killed, stop = threading.Event(), threading.Event()
    answers: list[tuple[bool, int, dict[str, Any]]] = []   # (sent after the kill, status, body)

    def client(seed: int) -> None:
        for p in prompts(seed, 1000):
            if stop.is_set():
                return
            after = killed.is_set()
            answers.append((after, *call(url + "/v1/generate",
                                         {"input_ids": p, "max_new_tokens": 8})))

    with ThreadPoolExecutor(6) as pool:
        loops = [pool.submit(client, seed) for seed in range(10, 16)]
        until("load on both replicas", lambda: len(answers) >= 12)
        os.kill(replicas[0], signal.SIGKILL)
        killed.set()
        until("requests after the kill", lambda: sum(a for a, *_ in answers) >= 30, 120)
        stop.set()
        for loop in loops:
            loop.result(timeout=120)
    later = [(status, body) for after, status, body in answers if after]
    assert all(status == 200 for status, _ in later), [a for a in later if a[0] != 200]
    # The dead replica comes back and attaches to the same workers: no second cluster.
    until("the replica restarted", lambda: len(pids := ingress_pids()) == 2
          and replicas[0] not in pids, 90)
    wait_for(url, lambda status, body: status == 200)
    assert {(r, i): pid_of(r, i) for r in ("prefill", "decode") for i in range(2)} == workers
    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith(f"{NAME}/")]
    assert len(named) == 5
    # The replica that created the workers may be gone: a worker killed now still restarts.
    victim = workers[("prefill", 1)]
    os.kill(victim, signal.SIGKILL)
    wait_for(url, lambda status, body: status == 200 and 1 in body["live"]["prefill"])
    assert pid_of("prefill", 1) != victim
    status, body = call(url + "/v1/generate", {"input_ids": prompts(3, 1)[0],
                                               "max_new_tokens": 4})
    assert status == 200, body
