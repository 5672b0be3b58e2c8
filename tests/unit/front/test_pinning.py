"""The pin a body asks for, and the tenant routes the admin pin calls take."""

from __future__ import annotations

import json

import pytest

from pd_cache.front.admin import tenant_route
from pd_cache.front.http import HTTPError, decode_json
from pd_cache.front.openai import ChatRequest, CompletionRequest


@pytest.mark.parametrize("extra, ttl", [
    ({}, 0.0),
    ({"pd_cache": {"pin_ttl_s": 90}}, 90.0),
    ({"prompt_cache_retention": "24h"}, 86400.0),
    ({"prompt_cache_retention": "in_memory"}, 0.0),
    ({"prompt_cache_retention": "24h", "pd_cache": {"pin_ttl_s": 90000}}, 90000.0),
])
def test_a_body_pins_for_the_longer_of_its_extension_and_its_retention(
        extra: dict[str, object], ttl: float) -> None:
    for kind, prompt in ((CompletionRequest, {"prompt": "x"}),
                         (ChatRequest, {"messages": [{"role": "user", "content": "x"}]})):
        body = json.dumps({"model": "tiny", **prompt, **extra}).encode()
        assert decode_json(body, kind).pin_ttl_s == ttl


@pytest.mark.parametrize("extra, param", [
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ({"pd_cache": {"pin_ttl_s": -1}}, "pd_cache.pin_ttl_s"),
    ({"pd_cache": {"pin_ttl": 5}}, "pd_cache"),
])
def test_a_bad_pin_is_a_400_naming_the_field(extra: dict[str, object], param: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x", **extra}).encode()
    with pytest.raises(HTTPError) as err:
        decode_json(body, CompletionRequest)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_tenant_routes() -> None:
    assert tenant_route("/admin/tenants/acme/pins") == ("GET", "pins", "acme")
    assert tenant_route("/admin/tenants/acme/pins/drop") == ("POST", "drop_pins", "acme")
    assert tenant_route("/admin/tenants/a%20b/purge") == ("POST", "purge", "a b")
    assert tenant_route("/v1/completions") is None
    for path in ("/admin/tenants//pins", "/admin/tenants/a/b/pins", "/admin/tenants/a/x"):
        with pytest.raises(HTTPError) as err:
            tenant_route(path)
        assert err.value.status == 404
