"""The Serve application on the session's Ray cluster, over real HTTP on 127.0.0.1.

Good requests must produce what the model produces with no cache at all; bad ones get
400 (413 for the body) naming the field; a dead worker gets 503, not a hang. The session's
cluster, started as every pd-cache command starts its own, opens no HTTP port beyond
loopback with this app on it (``pd-cache serve --dashboard``: ``test_auth.py``).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from pd_cache.core.config import ModelConfig
from pd_cache.core.request import Req
from pd_cache.model.model import Model, reference_generate

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

from pd_cache.front.serve import AppArgs, app_builder  # noqa: E402  (needs ray[serve])
from tests.integration.listening import descendants, http_listeners  # noqa: E402
from tests.integration.serving import running_app  # noqa: E402

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.yaml"
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 2, "num_decode": 1,
        "num_storage": 1, "storage_backend": "memory", "storage_capacity_bytes": 1 << 26,
        "prefetch_policy": "wait_complete", "device_pages": 64, "host_pages": 128,
        "request_timeout_s": 20.0, "max_body_bytes": 64 * 1024, "metrics_interval_s": 1.0,
        "cluster_name": None}   # an unnamed cluster: its actors go with the replica
MODEL = ModelConfig.preset("tiny")
APP = "pd-cache-test"


def _alive_actors(class_name: str) -> dict[str, int]:
    """Actor id -> pid of every live actor of ``class_name`` (read from the GCS)."""
    from ray._private import state

    return {aid: info["Pid"] for aid, info in state.actors().items()
            if info["ActorClassName"].endswith(class_name) and info["State"] == "ALIVE"}


class Server(NamedTuple):
    url: str
    decode_actors: list[str]  # the app's decode workers (actor ids: a restart keeps them)
    metrics_port: int


@pytest.fixture(scope="module")
def server(ray_cluster: Any, serve_url: str) -> Iterator[Server]:
    before = _alive_actors("DecodeActor")
    with running_app(serve_url, ARGS, APP) as url:
        ids = [aid for aid in _alive_actors("DecodeActor") if aid not in before]
        yield Server(url, ids, ray_cluster.metrics_port)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(MODEL)


def call(url: str, body: Any = None, *, raw: bytes | None = None, method: str | None = None,
         content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(MODEL.vocab_size) for _ in range(n)]


def reference(model: Model, input_ids: list[int], max_new: int) -> list[int]:
    return reference_generate(model, Req(rid="ref", input_ids=input_ids,
                                         max_new_tokens=max_new)).output_ids


def test_healthz(server: Server) -> None:
    status, body = call(server.url + "/healthz")
    assert (status, body["status"]) == (200, "ok")
    assert body["model"] == "tiny"
    assert body["workers"] == {"prefill": 2, "decode": 1, "storage": 1}
    assert body["live"] == {"prefill": [0, 1], "decode": [0], "storage": [0]}


def test_generate_equals_the_no_cache_model_and_reuses_turns(server: Server, model: Model) -> None:
    prompt = tokens(1, 22)
    status, first = call(server.url + "/v1/generate",
                         {"input_ids": prompt, "max_new_tokens": 6, "cache_salt": "tenant-a",
                          "rid": "conv-1/t0"})
    assert status == 200, first
    assert first["rid"] == "conv-1/t0"
    assert first["output_ids"] == reference(model, prompt, 6)
    assert first["num_prompt_tokens"] == 22 and first["ttft_ms"] > 0
    assert set(first["cached_tokens"]) == {"device", "host", "storage"}

    turn2 = prompt + first["output_ids"] + tokens(2, 5)
    status, second = call(server.url + "/v1/generate",
                          {"input_ids": turn2, "max_new_tokens": 6, "cache_salt": "tenant-a"})
    assert status == 200, second
    assert second["output_ids"] == reference(model, turn2, 6)
    # The first turn's full prompt pages at least, from whichever tier holds them.
    assert sum(second["cached_tokens"].values()) >= (len(prompt) // 4) * 4

    # The same tokens in another tenant's namespace reuse nothing.
    status, other = call(server.url + "/v1/generate",
                         {"input_ids": prompt, "max_new_tokens": 6, "cache_salt": "tenant-b"})
    assert status == 200 and sum(other["cached_tokens"].values()) == 0
    assert other["output_ids"] == first["output_ids"]


def stored_pages(port: int) -> float:
    """L3 pages stored by memory shards, as Ray's metrics port shows them."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "ray_pd_cache_storage_events_total"
               and s.labels.get("event") == "stored" and s.labels.get("backend") == "memory")


def test_the_l3_shards_export_their_counts(server: Server) -> None:
    # What earlier writes (of any test) have still to reach the port arrives first: the
    # count must hold still for a few export intervals before this test writes its own.
    port, quiet_s = server.metrics_port, 3 * ARGS["metrics_interval_s"]
    before, still_since, deadline = stored_pages(port), time.monotonic(), time.monotonic() + 30
    while time.monotonic() - still_since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        now = stored_pages(port)
        if now != before:
            before, still_since = now, time.monotonic()
    prompt = tokens(4, 22)   # this test's own prompt and tenant: nothing in L3 has them
    status, out = call(server.url + "/v1/generate",
                       {"input_ids": prompt, "max_new_tokens": 6, "cache_salt": "tenant-metrics"})
    assert status == 200 and sum(out["cached_tokens"].values()) == 0, out
    # 5 full prompt pages (prefill's write-through) and 1 of the answer (decode's offload:
    # 22 + 6 - 1 tokens have KV); decode may store a prompt page again if it looks first.
    want, stored = before + 22 // 4 + 1, before
    while stored < want and time.monotonic() < deadline + 30:
        time.sleep(0.5)
        stored = stored_pages(port)
    assert stored >= want


GOOD = {"input_ids": [1, 2, 3], "max_new_tokens": 2}
BAD_REQUESTS = [
    ("malformed JSON", b'{"input_ids": [1, 2', "body"),
    ("not an object", b"[1, 2, 3]", "body"),
    ("input_ids a string", {"input_ids": "1 2 3"}, "input_ids"),
    ("token a string", {"input_ids": [1, "2"]}, "input_ids[1]"),
    ("token a bool", {"input_ids": [True]}, "input_ids[0]"),
    ("max_new_tokens a string", {**GOOD, "max_new_tokens": "2"}, "max_new_tokens"),
    ("max_new_tokens negative", {**GOOD, "max_new_tokens": -1}, "max_new_tokens"),
    ("cache_salt a number", {**GOOD, "cache_salt": 7}, "cache_salt"),
    ("missing input_ids", {"max_new_tokens": 2}, "input_ids"),
    ("unknown field", {**GOOD, "prompt": "hi"}, "prompt"),
    ("empty prompt", {"input_ids": []}, "input_ids"),
    ("token beyond the vocabulary", {"input_ids": [1, MODEL.vocab_size]}, "input_ids[1]"),
    ("negative token", {"input_ids": [1, 2, -5]}, "input_ids[2]"),
    ("token beyond 2**32", {"input_ids": [2**40]}, "input_ids[0]"),
    ("empty cache_salt", {**GOOD, "cache_salt": ""}, "cache_salt"),
    ("extra_key too long", {**GOOD, "extra_key": "k" * 300}, "extra_key"),
    ("empty rid", {**GOOD, "rid": ""}, "rid"),
    ("prompt beyond the context", {"input_ids": [1] * MODEL.max_context}, "input_ids"),
]


@pytest.mark.parametrize("what, body, field", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_field(server: Server, what: str, body: Any,
                                             field: str) -> None:
    raw = body if isinstance(body, bytes) else None
    status, answer = call(server.url + "/v1/generate", None if raw else body, raw=raw)
    assert status == 400, (what, answer)
    assert answer["error"]["param"] == field, (what, answer)
    assert answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"


def test_oversized_body_is_413(server: Server) -> None:
    ids = [1] * (ARGS["max_body_bytes"] // 2)  # "1, " per token: over the limit
    status, answer = call(server.url + "/v1/generate", {"input_ids": ids})
    assert (status, answer["error"]["param"]) == (413, "body"), answer
    assert str(ARGS["max_body_bytes"]) in answer["error"]["message"]


def test_a_chunked_body_is_cut_off_as_it_streams_in(server: Server) -> None:
    # No Content-Length: the body arrives in chunks and is refused once past the limit.
    def chunks() -> Any:
        yield b'{"input_ids": ['
        for _ in range(ARGS["max_body_bytes"] // 1000 + 2):
            yield b"1, " * 333
        yield b"1]}"

    request = urllib.request.Request(server.url + "/v1/generate", data=chunks(),
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=60)
        raise AssertionError("accepted")
    except urllib.error.HTTPError as err:
        assert err.code == 413 and json.loads(err.read())["error"]["code"] == "too_large"


def test_only_json_bodies_and_plain_rids(server: Server) -> None:
    status, answer = call(server.url + "/v1/generate", raw=b'{"input_ids": [1]}',
                          content_type="text/plain")
    assert status == 415, answer
    status, answer = call(server.url + "/v1/generate", {**GOOD, "rid": "x" * 65})
    assert (status, answer["error"]["param"]) == (400, "rid")
    status, answer = call(server.url + "/v1/generate", {**GOOD, "rid": "a\nb"})
    assert (status, answer["error"]["param"]) == (400, "rid")


def test_ids_are_random_and_no_error_counts_requests(server: Server) -> None:
    """No id a client sees (its rid, a completion's id, a request named in an error) counts
    the requests before it: a tenant learns nothing of how many others sent."""
    def number(text: str, pattern: str) -> int:
        match = re.fullmatch(pattern, text)
        assert match, (pattern, text)
        return int(match.group(1), 16)

    def far_apart(numbers: list[int]) -> bool:   # a counter puts them 1 apart
        return all(abs(b - a) > 1 << 32 for a, b in zip(numbers, numbers[1:]))

    rids = [call(server.url + "/v1/generate", GOOD)[1]["rid"] for _ in range(3)]
    assert far_apart([number(r, r"http-([0-9a-f]{16})") for r in rids])
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    ids = [call(server.url + "/v1/completions", body)[1]["id"] for _ in range(3)]
    assert far_apart([number(i, r"cmpl-([0-9a-f]{24})") for i in ids])
    named = []
    for _ in range(3):   # an error that names the request names a random id
        status, answer = call(server.url + "/v1/generate", {"input_ids": []})
        assert status == 400, answer
        rid = re.search(r"rid='([^']*)'", answer["error"]["message"]).group(1)
        named.append(number(rid, r"http-([0-9a-f]{16})"))
    assert far_apart(named)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux /proc")
def test_the_session_cluster_opens_no_http_port_beyond_loopback(server: Server) -> None:
    """Every TCP socket the cluster's processes listen on gets a plain GET: those that
    answer HTTP (metrics export, autoscaler metrics, dashboard and runtime-env agents,
    Serve's proxy) have no token in front of them and must be bound to loopback; Ray's
    gRPC servers (token-authenticated) do not answer a GET and are exempt."""
    found = http_listeners(descendants(os.getpid()))
    proxy_port = int(server.url.rsplit(":", 1)[1])
    assert {proxy_port, server.metrics_port} <= {s.port for s in found}, found
    assert [s for s in found if not s.loopback] == []


def test_unknown_route_and_wrong_method(server: Server) -> None:
    assert call(server.url + "/v1/nothing")[0] == 404
    status, answer = call(server.url + "/v1/generate", method="GET")
    assert status == 405 and "POST" in answer["error"]["message"]


def test_skipped_manifest_schema_check_now_runs() -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))
    assert schema.applications[0].import_path == "pd_cache.front.serve:app"


def test_deployments_config_builds_through_app_builder() -> None:
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    (entry,) = config["applications"]
    module, attr = entry["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert builder is app_builder
    application = builder(entry["args"])
    assert isinstance(application, serve.Application)
    args = application._bound_deployment.init_args[0]  # what the ingress will start from
    assert isinstance(args, AppArgs)
    cfg = args.cluster
    assert (cfg.model, cfg.num_prefill, cfg.num_decode, cfg.num_storage, cfg.prefetch_policy) == (
        entry["args"]["model"], entry["args"]["num_prefill"],
        entry["args"]["num_decode"], entry["args"]["num_storage"],
        entry["args"]["prefetch_policy"])
    with pytest.raises(ValueError, match="num_prefill"):
        builder({**entry["args"], "num_prefill": "two"})
    with pytest.raises(ValueError, match="replicas"):
        builder({**entry["args"], "replicas": 3})


def test_the_only_decode_worker_killed_is_never_a_hang(server: Server, model: Model) -> None:
    assert call(server.url + "/healthz")[0] == 200
    (actor,) = server.decode_actors
    os.kill(_alive_actors("DecodeActor")[actor], signal.SIGKILL)   # the app's only decode
    start = time.monotonic()
    prompt = tokens(3, 9)
    status, answer = call(server.url + "/v1/generate", {"input_ids": prompt})
    # Either the call reached the dead process (503: the one decode worker is down), or Ray
    # already held it for the restarting actor (200, and right); never a hang.
    assert status in (200, 503), answer
    if status == 200:
        assert answer["output_ids"] == reference(model, prompt, 16)
    assert time.monotonic() - start < ARGS["request_timeout_s"] + 10
    # The actor restarts: the app answers right again, as the tests after this one expect.
    deadline = time.monotonic() + 60
    while call(server.url + "/healthz")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    prompt = tokens(5, 9)
    status, out = call(server.url + "/v1/generate",
                       {"input_ids": prompt, "max_new_tokens": 3, "cache_salt": "tenant-dead"})
    assert status == 200, out
    assert out["output_ids"] == reference(model, prompt, 3)

