"""Tenant controls over HTTP, with API keys. Pinned prefixes: a pinned system prompt longer
than half of either worker pool (held in the two together) outlives a flood that evicts an
unpinned one from every tier, a pin over the tenant's ``max_pinned_bytes`` is
refused before any work, and the admin routes list and drop a tenant's pins. A fair share:
a quiet tenant is served in full while another floods the ingress past ``max_pending``.
Real HTTP on 127.0.0.1, the real ``openai`` client, a small pool and L3 so that a few
prompts flood them."""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pd_cache import ModelConfig, Req, reference_generate
from pd_cache.core.config import CacheConfig, PDCacheConfig
from pd_cache.front.tokenizer import ByteTokenizer
from pd_cache.model.model import Model

openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

from pd_cache.cluster.operations import NAMESPACE  # noqa: E402
from tests.integration.metrics_port import samples  # noqa: E402
from tests.integration.serving import running_app  # noqa: E402  (needs ray[serve])

NAME, APP = "pd-cache-pins", "pd-cache-pins-app"
MODEL = ModelConfig.preset("tiny")
PS = 4
PAGE_BYTES = PDCacheConfig(model=MODEL, cache=CacheConfig(page_size=PS)).layout.page_nbytes
MAX_PINNED = 24 * PAGE_BYTES          # the tenant's limit: 24 pages
# NOTE: "pinner"'s second key is an admin one: its answers show cached tokens by tier.
KEYS = {"keys": {"sk-pins-0001": "pinner", "sk-pins-0002": {"tenant": "pinner", "admin": True},
                 "sk-ops-00003": {"tenant": "ops", "admin": True},
                 "sk-noisy-0004": "noisy", "sk-quiet-0005": "quiet"},
        "tenants": {"pinner": {"max_pinned_bytes": MAX_PINNED}}}
# NOTE: 32 pages per pool (at most 16 pinned in each, 32 in a worker), L3 of about 40 pages
# (at most 20 pinned): ten prompts of 11 pages flood them all.
ARGS = {"model": "tiny", "page_size": PS, "num_prefill": 1, "num_decode": 1, "num_storage": 1,
        "device_pages": 32, "host_pages": 32, "storage_capacity_bytes": 40 * PAGE_BYTES,
        "cluster_name": NAME, "max_pending": 16}
TOK = ByteTokenizer(MODEL.vocab_size)
PIN = {"pd_cache": {"pin_ttl_s": 600}}


@pytest.fixture(scope="module")
def url(serve_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from pd_cache import PDCluster

    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    try:
        with running_app(serve_url, ARGS | {"api_keys_file": str(keys)}, APP) as url:
            yield url
    finally:
        PDCluster.destroy(NAME)


def client(url: str, key: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def chat(who: Any, system: str, question: str, model: Model, tiers: tuple[str, ...] = (),
         **extra: Any) -> int:
    """Ask; check the answer is the no-cache model's; the prompt tokens found cached (in
    ``tiers``: an admin key's answer says)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    out = who.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                      extra_body=extra or None)
    want = reference_generate(model, Req(rid="ref", input_ids=TOK.chat(messages),
                                         max_new_tokens=3)).output_ids
    assert out.choices[0].model_extra["token_ids"] == want
    if tiers:
        return sum(out.model_extra["pd_cache"]["cached_tokens"][t] for t in tiers)
    return out.usage.prompt_tokens_details.cached_tokens


def admin(url: str, path: str, key: str = "sk-ops-00003") -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    method = "POST" if path.endswith("/drop") else "GET"
    request = urllib.request.Request(url + path, data=b"" if method == "POST" else None,
                                     headers={"Authorization": f"Bearer {key}"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_pinned_system_prompt_outlives_a_flood_within_the_tenants_limit(
        url: str, ray_cluster: Any) -> None:
    model, pinner = Model(MODEL), client(url, "sk-pins-0001")
    # NOTE: 18 pages (75 tokens): more than half of either pool (16), so refused before
    # pins counted both tiers. The answer's tokens in KV complete a 19th page, which decode
    # writes to L3 unpinned: only the prompt's pages are the tenant's pins.
    pinned = "You are the pinned assistant of acme; answer all questions briefly. "
    unpinned = "Zeta's helper answers briefly, always. "   # no first page in common
    assert chat(pinner, pinned, "q0", model, **PIN) == 0
    assert chat(pinner, unpinned, "q0", model) == 0
    status, held = admin(url, "/admin/tenants/pinner/pins")
    pages = len(TOK.chat([{"role": "system", "content": pinned},
                          {"role": "user", "content": "q0"}])) // PS
    assert pages > 16 and status == 200 and held["pages"] == pages
    assert held["bytes"] == pages * PAGE_BYTES
    assert 590 < held["expires_in_s"] <= 600 and held["on_workers"] >= pages, held
    assert held["on_storage"] == pages and len(held["names"]) == pages, held
    assert admin(url, "/admin/tenants/pinner/pins", "sk-pins-0001")[0] == 403
    for i in range(10):                   # unique prompts of 11 pages: every tier floods
        chat(pinner, f"flood {i} " + "x" * 30, "q", model)
    status, after = admin(url, "/admin/tenants/pinner/pins")   # every pin held on
    assert (after["pages"], after["on_workers"], after["on_storage"]) == \
        (pages, held["on_workers"], pages), after
    system_pages = len(TOK.chat([{"role": "system", "content": pinned}])) // PS
    assert chat(client(url, "sk-pins-0002"), pinned, "q1", model, ("device", "host")) \
        >= system_pages * PS                                          # from L1 and L2
    assert chat(pinner, unpinned, "q1", model) == 0                 # gone from every tier
    # over max_pinned_bytes (OpenAI's 24 h retention is a pin): refused before any work
    other = "Another long system prompt to pin. "
    with pytest.raises(openai.BadRequestError) as err:
        chat(pinner, other, "q0", model, prompt_cache_retention="24h")
    assert err.value.body["param"] == "max_pinned_bytes", err.value.body
    assert f"max_pinned_bytes={MAX_PINNED}" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat(pinner, other, "q0", model, prompt_cache_retention="1h")
    assert err.value.body["param"] == "prompt_cache_retention"
    assert pinned_gauge(ray_cluster.metrics_port) == pages * PAGE_BYTES
    status, dropped = admin(url, "/admin/tenants/pinner/pins/drop")
    assert status == 200 and dropped["dropped_pins"] >= 2 * pages, dropped
    assert admin(url, "/admin/tenants/pinner/pins")[1]["pages"] == 0
    assert chat(pinner, other, "q0", model, prompt_cache_retention="24h") == 0   # nothing
    assert admin(url, "/admin/tenants/pinner/pins")[1]["pages"] > 0   # was computed before
    assert admin(url, "/admin/tenants/pinner/pins/drop")[0] == 200
    assert_empty_after_drop(url)


def test_a_quiet_tenant_is_served_in_full_while_another_floods(url: str) -> None:
    """24 clients of "noisy" keep unique 900-token prompts coming, more than the replica's
    16 places; "quiet" asks 8 questions meanwhile. The flood fills the places and is shed
    (429) past them; quiet's share of the places (16 // 2) admits it, and its prefills wait
    their turn beside noisy's queue, not behind it. Every answer is the no-cache model's."""
    from concurrent.futures import ThreadPoolExecutor

    model, stop = Model(MODEL), threading.Event()
    noisy: collections.Counter[int] = collections.Counter()

    def flood(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ids = [rng.randrange(256) for _ in range(900)]
            noisy[post(url, "sk-noisy-0004", {"model": "tiny", "prompt": ids,
                                               "max_tokens": 1})] += 1

    with ThreadPoolExecutor(24) as pool:
        floods = [pool.submit(flood, i) for i in range(24)]
        try:
            deadline = time.monotonic() + 60
            while not noisy[429]:           # the replica is full: noisy is being shed
                assert time.monotonic() < deadline and not any(f.done() for f in floods), \
                    noisy
                time.sleep(0.05)
            quiet = client(url, "sk-quiet-0005")
            for i in range(8):              # any 429 or 503 raises here
                chat(quiet, "You are quiet's assistant. ", f"question {i}", model)
        finally:
            stop.set()                      # the flood ends, whatever failed
        for f in floods:
            f.result(timeout=120)
    assert set(noisy) <= {200, 429, 503} and noisy[200] > 0, noisy   # shed, or queued
    assert_empty_after_drop(url)


def post(url: str, key: str, body: dict[str, Any]) -> int:
    """A completion's HTTP status."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        err.read()
        return err.code


def pinned_gauge(port: int) -> float | None:
    """``pd_cache_tenant_pinned_bytes{tenant="pinner"}`` once exported (or after 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        got = [s.value for s in samples(port) if s.name == "ray_pd_cache_tenant_pinned_bytes"
               and s.labels.get("tenant") == "pinner"]
        if got or time.monotonic() > deadline:
            return got[0] if got else None
        time.sleep(0.5)


def assert_empty_after_drop(url: str) -> None:
    """After an admin drop of every cache, no lock, no slot and no L3 record is left."""
    import urllib.request

    request = urllib.request.Request(url + "/admin/drop_caches", data=b"", method="POST",
                                     headers={"Authorization": "Bearer sk-ops-00003"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 200
    workers = [ray.get_actor(f"{NAME}/{role}-0", namespace=NAMESPACE)
               for role in ("prefill", "decode")]
    for state in ray.get([w.state.remote() for w in workers]):
        assert state.locks == 0, state
        assert all(not owners for owners in state.pool_usage.values()), state
    shard = ray.get_actor(f"{NAME}/storage-0", namespace=NAMESPACE)
    assert ray.get(shard.usage.remote()).records == 0
