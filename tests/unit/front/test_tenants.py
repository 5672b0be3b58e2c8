"""Tenants the server vouches for: key files, the secret, the derived namespace salt."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pd_cache.front.keyfile import KeyRate, TenantLimits, parse_key_file
from pd_cache.front.tenants import Tenant, Tenants, Unauthorized


def hmac_sha256(key: bytes, message: bytes) -> str:
    """HMAC written out from its definition (RFC 2104), independent of the hmac module."""
    block = 64
    key = key.ljust(block, b"\x00")
    inner = hashlib.sha256(bytes(k ^ 0x36 for k in key) + message).digest()
    return hashlib.sha256(bytes(k ^ 0x5C for k in key) + inner).hexdigest()


def keys_file(tmp_path: Path, keys: object) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(keys))
    return path


def test_the_salt_is_hmac_of_tenant_and_client_salt(tmp_path: Path) -> None:
    path = keys_file(tmp_path, {"sk-acme-0001": "acme",
                                "sk-ops-00002": {"tenant": "ops", "admin": True}})
    old = os.umask(0o002)
    try:
        tenants = Tenants.from_file(path)
    finally:
        os.umask(old)
    secret_file = tmp_path / "keys.json.secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = bytes.fromhex(secret_file.read_text())
    acme = tenants.tenant("Bearer sk-acme-0001")
    assert (acme.name, acme.admin) == ("acme", False)
    assert tenants.tenant("bearer sk-ops-00002").admin
    assert tenants.cache_salt(acme, None) == hmac_sha256(secret, b"acme\x00")
    assert tenants.cache_salt(acme, "team-1") == hmac_sha256(secret, b"acme\x00team-1")
    assert tenants.cache_salt(acme, "ops") != tenants.cache_salt(Tenant("ops"), None)
    again = Tenants.from_file(path)                 # a restart keeps the same namespaces
    assert again.cache_salt(acme, "x") == tenants.cache_salt(acme, "x")


@pytest.mark.parametrize("header", [None, "", "sk-acme-0001", "Basic sk-acme-0001",
                                    "Bearer ", "Bearer sk-unknown-01"])
def test_a_missing_or_unknown_key_is_unauthorized(tmp_path: Path, header: str | None) -> None:
    tenants = Tenants.from_file(keys_file(tmp_path, {"sk-acme-0001": "acme"}))
    with pytest.raises(Unauthorized):
        tenants.tenant(header)


@pytest.mark.parametrize("keys, match", [
    ([], "non-empty JSON object"), ({}, "non-empty JSON object"),
    ({"short": "acme"}, "at least 8"), ({"sk-acme-0001": ""}, "tenant name"),
    ({"sk-acme-0001": {"admin": True}}, "tenant name"),
    ({"sk-acme-0001": {"tenant": "a", "admin": "yes"}}, "'sk-a'.*'a'.*admin: expected true"),
    ({"sk-acme-0001": {"tenant": "a", "role": "x"}}, "'sk-a'.*tenant 'a'.*unknown field 'role'"),
    # the top-level form: every unknown field names the key's first 4 characters, the
    # tenant and the field; bad values name the field and the bound
    ({"keys": {"sk-acme-0001": {"tenant": "acme", "request_per_s": 5}}},
     r"key 'sk-a'\.\.\. \(tenant 'acme'\): unknown field 'request_per_s'"),
    ({"keys": {"sk-acme-0001": "acme"}, "tenants": {"acme": {"l3_quota": 1}}},
     "tenant 'acme': unknown field 'l3_quota'"),
    ({"keys": {"sk-acme-0001": "acme"}, "limits": {}}, "unknown top-level field 'limits'"),
    ({"keys": {}}, "'keys': expected a non-empty"), ({"tenants": {}}, "'keys': expected"),
    ({"keys": {"sk-acme-0001": "acme"}, "tenants": {"zeta": {}}}, "'zeta': no key belongs"),
    ({"keys": {"sk-acme-0001": "acme"}, "tenants": {"acme": 5}}, "'acme': expected a JSON"),
    ({"keys": {"sk-acme-0001": {"tenant": "a", "requests_per_s": 0}}},
     "requests_per_s: expected a number > 0, got 0"),
    ({"keys": {"sk-acme-0001": {"tenant": "a", "tokens_per_min": 1.5}}},
     "tokens_per_min: expected an integer >= 1"),
    ({"keys": {"sk-acme-0001": {"tenant": "a", "tokens_per_min": True}}}, "tokens_per_min"),
    ({"keys": {"sk-acme-0001": "a"}, "tenants": {"a": {"max_pinned_bytes": -1}}},
     "'a': max_pinned_bytes: expected an integer >= 0, got -1"),
])
def test_bad_key_files_name_the_problem(tmp_path: Path, keys: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_key_file(keys_file(tmp_path, keys))


def test_an_unreadable_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_key_file(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        parse_key_file(tmp_path / "bad.json")


def test_the_top_level_form_keeps_rates_per_key_and_quotas_per_tenant(tmp_path: Path) -> None:
    path = keys_file(tmp_path, {
        "keys": {"sk-acme-0001": {"tenant": "acme", "requests_per_s": 0.5,
                                  "tokens_per_min": 600},
                 "sk-acme-0002": "acme",
                 "sk-ops-00003": {"tenant": "ops", "admin": True, "requests_per_s": None}},
        "tenants": {"acme": {"l3_quota_bytes": 1 << 26, "max_pinned_bytes": 0}}})
    parsed = parse_key_file(path)
    assert parsed.keys["sk-acme-0001"] == Tenant("acme", rate=KeyRate(0.5, 600))
    assert parsed.keys["sk-acme-0002"] == Tenant("acme")
    assert parsed.keys["sk-ops-00003"] == Tenant("ops", admin=True)
    assert parsed.tenants == {"acme": TenantLimits(1 << 26, 0)}
    tenants = Tenants.from_file(path)
    assert tenants.names == ("acme", "ops") and tenants.limits == parsed.tenants
    limited, other = tenants.tenant("Bearer sk-acme-0001"), tenants.tenant("Bearer sk-acme-0002")
    assert limited.rate == KeyRate(0.5, 600) and other.rate == KeyRate()
    # one tenant, two keys, two buckets; the bucket's name is not the key
    assert limited.key_id != other.key_id and len(limited.key_id) == 16
    assert "sk-acme" not in limited.key_id
    # the flat form is the top-level form's "keys" alone
    flat = keys_file(tmp_path, {"sk-acme-0002": "acme"})
    assert parse_key_file(flat).keys == {"sk-acme-0002": Tenant("acme")}
