"""Tenants the server vouches for: key files, the secret, the derived namespace salt."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pd_cache.front.tenants import Tenant, Tenants, Unauthorized, parse_keys


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
    assert acme == Tenant("acme") and tenants.tenant("bearer sk-ops-00002").admin
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
    ({"sk-acme-0001": {"tenant": "a", "admin": "yes"}}, "tenant name"),
    ({"sk-acme-0001": {"tenant": "a", "role": "x"}}, "tenant name"),
])
def test_bad_key_files_name_the_problem(tmp_path: Path, keys: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_keys(keys_file(tmp_path, keys))


def test_an_unreadable_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_keys(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        parse_keys(tmp_path / "bad.json")
