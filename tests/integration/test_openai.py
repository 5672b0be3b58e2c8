"""The OpenAI-compatible front driven by the real ``openai`` client, with API keys: two
tenants, an admin key, streaming and not, usage with cached tokens, errors in OpenAI's
shape, backpressure, rate limits per key and usage per tenant on the Ray metrics port.
Real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_cache import ModelConfig, Req, reference_generate
from pd_cache.front.tokenizer import ByteTokenizer
from pd_cache.model.model import Model

openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

from tests.integration.metrics_port import samples  # noqa: E402
from tests.integration.serving import running_app  # noqa: E402  (needs ray[serve])

APP = "pd-cache-openai"
MODEL = ModelConfig.preset("tiny")
# NOTE: the key file's top-level form; "slow" has two keys, each with its own rate limits.
KEYS = {"keys": {"sk-acme-0001": "acme", "sk-zeta-0002": "zeta",
                 "sk-ops-00003": {"tenant": "ops", "admin": True},
                 "sk-slow-0004": {"tenant": "slow", "requests_per_s": 0.01},
                 "sk-slow-0005": {"tenant": "slow", "tokens_per_min": 40}},
        "tenants": {"slow": {"l3_quota_bytes": 1 << 20, "max_pinned_bytes": 0}}}


@pytest.fixture(scope="module")
def url(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = {"model": "tiny", "page_size": 4, "num_prefill": 1, "num_decode": 1,
            "num_storage": 1, "device_pages": 64, "host_pages": 128, "cluster_name": None,
            "api_keys_file": str(keys), "max_pending": 3}
    with running_app(serve_url, args, APP) as url:
        yield url
    secret = Path(str(keys) + ".secret")
    assert secret.stat().st_mode & 0o777 == 0o600    # created private on first start


def client(url: str, key: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(MODEL)


def reference(model: Model, ids: list[int], n: int) -> list[int]:
    return reference_generate(model, Req(rid="ref", input_ids=ids, max_new_tokens=n)).output_ids


TOK = ByteTokenizer(MODEL.vocab_size)
PROMPT = "The quick brown fox jumps over the lazy dog, " * 2


def test_completion_equals_the_model_and_reports_the_tenants_own_reuse(url: str,
                                                                     model: Model) -> None:
    acme, zeta = client(url, "sk-acme-0001"), client(url, "sk-zeta-0002")
    first = acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    want = reference(model, TOK.encode(PROMPT), 6)
    assert first.choices[0].model_extra["token_ids"] == want
    assert first.choices[0].text == TOK.decode(want)
    assert first.usage.prompt_tokens == len(TOK.encode(PROMPT))
    assert first.usage.completion_tokens == 6
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    other = zeta.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert other.usage.prompt_tokens_details.cached_tokens == 0   # another tenant: nothing
    again = acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].model_extra["token_ids"] == want
    assert "pd_cache" not in again.model_extra                   # per-tier details: admin only
    # a client salt only subdivides its tenant: acme's "zeta" salt is not zeta's namespace
    salted = acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                     extra_body={"cache_salt": "zeta"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompts_streaming_and_usage_chunks(url: str, model: Model) -> None:
    ops = client(url, "sk-ops-00003")
    ids = TOK.encode("stream me, please")
    sent = time.time_ns()
    chunks = list(ops.completions.create(model="tiny", prompt=ids, max_tokens=8, stream=True,
                                         stream_options={"include_usage": True}))
    done = time.time_ns()
    hops = chunks[-1].model_extra["pd_cache"]      # the overhead breakdown's clock reads
    assert sent < hops["received_ns"] <= hops["body_ns"] <= hops["admitted_ns"] \
        < hops["first_token_ns"] < done
    assert 0 < hops["prefill_ms"] <= hops["ttft_ms"]
    assert hops["first_token_ns"] - hops["received_ns"] >= hops["ttft_ms"] * 1e6
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert tokens == reference(model, ids, 8)
    assert len([c for c in chunks if c.choices and c.choices[0].model_extra["token_ids"]]) == 8
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    assert chunks[-1].model_extra["pd_cache"]["cached_tokens"].keys() == {"device", "host",
                                                                          "storage"}


def test_chat_streaming_and_not_match_the_template(url: str, model: Model) -> None:
    ops = client(url, "sk-ops-00003")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = reference(model, TOK.chat(messages), 5)
    whole = ops.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == TOK.decode(want)
    assert whole.model_extra["pd_cache"]["attempts"] == 1
    parts = list(ops.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                             stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == TOK.decode(want)
    assert [m.id for m in ops.models.list().data] == ["tiny"]


def test_errors_are_in_openai_shape(url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(url, "sk-not-a-key").completions.create(model="tiny", prompt="x", max_tokens=1)
    acme = client(url, "sk-acme-0001")
    with pytest.raises(openai.NotFoundError) as err:
        acme.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        acme.completions.create(model="tiny", prompt=[1, 2, 10**6], max_tokens=1)
    assert err.value.body["param"] == "prompt[2]"
    with pytest.raises(openai.BadRequestError) as err:   # the tiny model's context: 1024
        acme.chat.completions.create(model="tiny", max_tokens=1000, messages=[
            {"role": "user", "content": "x" * 100}])
    assert err.value.body["param"] == "messages" and "max_tokens=1000" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        acme.chat.completions.create(model="tiny", temperature=1e308, messages=[
            {"role": "user", "content": "x"}])
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        acme.completions.create(model="tiny", prompt="", max_tokens=1)
    status, body = raw(url + "/v1/completions", b'{"model": "tiny", "prompt": "x"}',
                       {"Authorization": "Bearer sk-acme-0001", "Content-Type": "text/plain"})
    assert status == 415 and body["error"]["type"] == "invalid_request_error"
    status, body = raw(url + "/v1/completions", b"{}", {"Content-Type": "application/json"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_beyond_max_pending_is_429_with_retry_after(url: str) -> None:
    acme = client(url, "sk-acme-0001")
    streams = [acme.completions.create(model="tiny", prompt=f"hold {i}", max_tokens=200,
                                       stream=True) for i in range(3)]
    try:
        status, body = raw(url + "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "one more", "max_tokens": 1}).encode(),
            {"Authorization": "Bearer sk-acme-0001", "Content-Type": "application/json"},
            want_headers=True)
        headers = {k.lower(): v for k, v in body[1].items()}
        assert status == 429 and headers.get("retry-after") == "1", body
    finally:
        for s in streams:
            s.close()   # the client goes away: its decode is cancelled
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            acme.completions.create(model="tiny", prompt="after", max_tokens=1)
            return
        except openai.RateLimitError:
            time.sleep(0.2)
    raise AssertionError("places were not given back after the streams closed")


def test_a_key_over_its_rate_gets_429_with_retry_after_and_the_others_are_served(
        url: str, ray_cluster: Any) -> None:
    slow, acme = client(url, "sk-slow-0004"), client(url, "sk-acme-0001")
    start = time.monotonic()
    served = slow.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    with pytest.raises(openai.RateLimitError) as err:   # 0.01 requests/s: one, then wait
        slow.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    elapsed_ms = (time.monotonic() - start) * 1000
    headers = err.value.response.headers
    # One request per 100 s: the wait is what is left of the 100 s since the first was
    # taken, which was within the span measured here; Retry-After is it in whole seconds.
    wait_ms = int(headers["retry-after-ms"])
    assert 100_000 - elapsed_ms - 1 <= wait_ms <= 100_000
    assert int(headers["retry-after"]) == math.ceil(wait_ms / 1000)
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert err.value.body["code"] == "rate_limit_exceeded"
    assert err.value.response.json()["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):           # a stream is refused before it starts
        slow.chat.completions.create(model="tiny", max_tokens=2, stream=True,
                                     messages=[{"role": "user", "content": "hi"}])
    # the others are served meanwhile: another tenant, and the same tenant's other key
    assert acme.completions.create(model="tiny", prompt=PROMPT, max_tokens=3) \
        .choices[0].model_extra["token_ids"] == served.choices[0].model_extra["token_ids"]
    budget = client(url, "sk-slow-0005")                 # 40 tokens a minute
    small = budget.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as err:    # prompt + max_tokens > 40: never
        budget.completions.create(model="tiny", prompt="x" * 39, max_tokens=2)
    assert err.value.body["code"] == "request_too_large" and "40 tokens" in err.value.message
    assert "retry-after" not in err.value.response.headers
    # usage by tenant, exported by the ingress replica: the two served requests, three 429s
    want = {("tokens", "prompt"): served.usage.prompt_tokens + small.usage.prompt_tokens,
            ("tokens", "generated"): served.usage.completion_tokens
            + small.usage.completion_tokens, ("rate_limited", ""): 3}
    assert tenant_counts(ray_cluster.metrics_port, "slow", want) == want
    # and the L3 bytes its pages hold, under its quota (the shard enforces it by owner label)
    quota = KEYS["tenants"]["slow"]["l3_quota_bytes"]
    assert 0 < l3_bytes(ray_cluster.metrics_port, "slow") <= quota


def tenant_counts(port: int, tenant: str, want: dict[tuple[str, str], float]) -> dict[
        tuple[str, str], float]:
    """``pd_cache_tenant_*_total`` of ``tenant`` at the Ray metrics port, by (what, token
    kind), once they equal ``want`` or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        got: dict[tuple[str, str], float] = {}
        for s in samples(port):
            if s.labels.get("tenant") == tenant and s.name.endswith("_total"):
                what = s.name.removeprefix("ray_pd_cache_tenant_").removesuffix("_total")
                key = (what, s.labels.get("token_kind", ""))
                got[key] = got.get(key, 0) + s.value
        got = {k: v for k, v in got.items() if k in want}
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def l3_bytes(port: int, tenant: str) -> float:
    """``pd_cache_tenant_l3_bytes`` of ``tenant`` (the largest any replica exports), once
    above 0 or after 30 s (the ingress exports it every metrics interval)."""
    deadline = time.monotonic() + 30
    while True:
        held = max((s.value for s in samples(port) if s.labels.get("tenant") == tenant
                    and s.name == "ray_pd_cache_tenant_l3_bytes"), default=0.0)
        if held > 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def test_admin_drop_caches_empties_the_cache_and_needs_an_admin_key(url: str) -> None:
    acme = client(url, "sk-acme-0001")
    prompt = "a prompt to be cached and then dropped " * 2
    acme.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert acme.completions.create(model="tiny", prompt=prompt, max_tokens=2) \
        .usage.prompt_tokens_details.cached_tokens > 0
    status, body = raw(url + "/admin/drop_caches", b"", {"Authorization": "Bearer sk-acme-0001"})
    assert status == 403 and body["error"]["code"] == "permission_denied"
    assert body["error"]["type"] == "permission_error"
    status, body = raw(url + "/admin/drop_caches", b"", {"Authorization": "Bearer sk-ops-00003"})
    assert status == 200 and body["dropped_pages"]["device"] > 0, body
    assert body["dropped_pages"]["storage"] > 0, body
    assert acme.completions.create(model="tiny", prompt=prompt, max_tokens=2) \
        .usage.prompt_tokens_details.cached_tokens == 0


def test_admin_purge_forgets_one_tenant_and_keys_rotate(url: str) -> None:
    """Through HTTP: a purge leaves acme 0 cached tokens while zeta keeps its own; only an
    admin key may purge or rotate."""
    acme, zeta = client(url, "sk-acme-0001"), client(url, "sk-zeta-0002")
    prompt = "a prompt both tenants send, then one of them is purged " * 2

    def cached(who: Any) -> int:
        return who.completions.create(model="tiny", prompt=prompt, max_tokens=2) \
            .usage.prompt_tokens_details.cached_tokens

    cached(acme), cached(zeta)
    assert cached(acme) > 0 and cached(zeta) > 0
    admin, user = {"Authorization": "Bearer sk-ops-00003"}, \
        {"Authorization": "Bearer sk-acme-0001"}
    for path in ("/admin/tenants/acme/purge", "/admin/keys/rotate", "/admin/keys/retire"):
        status, body = raw(url + path, b"", user)
        assert status == 403 and body["error"]["code"] == "permission_denied", (path, body)
    status, body = raw(url + "/admin/tenants/acme/purge", b"", admin)
    assert status == 200 and body["tenant"] == "acme" and body["dropped_pages"] > 0, body
    assert cached(acme) == 0
    assert cached(zeta) > 0
    status, body = raw(url + "/admin/keys/rotate", b"", admin)
    assert status == 200 and body["key_version"] == body["oldest_readable"] + 1, body
    assert cached(zeta) > 0   # its pages, and its records sealed before, stay readable


def raw(url: str, data: bytes, headers: dict[str, str],
        want_headers: bool = False) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            body = json.loads(resp.read())
            return resp.status, (body, dict(resp.headers)) if want_headers else body
    except urllib.error.HTTPError as err:
        body = json.loads(err.read())
        return err.code, (body, dict(err.headers)) if want_headers else body


