"""The API-key file: which key belongs to which tenant, and the limits of each.

Two forms. The flat one maps a key to a tenant name or ``{"tenant": name, "admin": true}``::

    {"sk-a-0001": "acme", "sk-ops-0002": {"tenant": "ops", "admin": true}}

The top-level one adds limits: rate limits per key, quotas per tenant::

    {"keys": {"sk-a-0001": {"tenant": "acme", "requests_per_s": 5, "tokens_per_min": 60000},
              "sk-ops-0002": {"tenant": "ops", "admin": true}},
     "tenants": {"acme": {"l3_quota_bytes": 67108864, "max_pinned_bytes": 8388608}}}

Keys are at least 8 characters. Every error names the key by its first 4 characters (never
the whole key), its tenant and the field, so a typo (``request_per_s``) stops the server at
start instead of silently leaving a key unlimited.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

KEY_FIELDS = ("tenant", "admin", "requests_per_s", "tokens_per_min")
TENANT_FIELDS = ("l3_quota_bytes", "max_pinned_bytes")


class KeyRate(NamedTuple):
    """A key's rate limits; ``None`` is unlimited."""

    requests_per_s: float | None = None
    tokens_per_min: int | None = None


class TenantLimits(NamedTuple):
    """A tenant's quotas (bytes); ``None`` is none. ``l3_quota_bytes`` is enforced by the
    L3 shards (``front.guard.TenantL3`` pushes it); ``max_pinned_bytes`` not yet."""

    l3_quota_bytes: int | None = None
    max_pinned_bytes: int | None = None


class Tenant(NamedTuple):
    """Who a request's key vouches for: the tenant, and the key's own identity and rate.

    ``key_id`` names the key without revealing it (a digest prefix), for its rate bucket."""

    name: str
    admin: bool = False
    key_id: str = ""
    rate: KeyRate = KeyRate()


class KeyFile(NamedTuple):
    keys: dict[str, Tenant]
    tenants: dict[str, TenantLimits]


def parse_key_file(path: Path) -> KeyFile:
    """The key file, either form; ``ValueError`` naming what is wrong."""
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"api_keys_file: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"api_keys_file: {path} is not JSON: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"api_keys_file: {path}: expected a non-empty JSON object")
    # NOTE: "keys" and "tenants" are shorter than any key, so the forms cannot be confused.
    if not set(raw) & {"keys", "tenants"}:
        return KeyFile({key: _key(key, value) for key, value in raw.items()}, {})
    unknown = sorted(set(raw) - {"keys", "tenants"})
    if unknown:
        raise ValueError(f"api_keys_file: unknown top-level field {unknown[0]!r}; expected "
                         f"'keys' and 'tenants'")
    keys, tenants = raw.get("keys"), raw.get("tenants", {})
    if not isinstance(keys, dict) or not keys:
        raise ValueError("api_keys_file: 'keys': expected a non-empty JSON object")
    if not isinstance(tenants, dict):
        raise ValueError("api_keys_file: 'tenants': expected a JSON object")
    parsed = {key: _key(key, value) for key, value in keys.items()}
    named = {t.name for t in parsed.values()}
    return KeyFile(parsed, {name: _limits(name, value, named)
                            for name, value in tenants.items()})


def _key(key: str, value: object) -> Tenant:
    where = f"api_keys_file: key {key[:4]!r}..."
    if len(key) < 8:
        raise ValueError(f"{where}: keys are at least 8 characters")
    if isinstance(value, str) and value:
        return Tenant(value)
    if not isinstance(value, dict) or not isinstance(value.get("tenant"), str) \
            or not value["tenant"]:
        raise ValueError(f"{where}: expected a tenant name or {{\"tenant\": name, ...}}, "
                         f"got {value!r}")
    where += f" (tenant {value['tenant']!r})"
    _known(where, value, KEY_FIELDS)
    admin = value.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}: admin: expected true or false, got {admin!r}")
    rps = _number(where, value, "requests_per_s", integer=False, least=0, open_low=True)
    tpm = _number(where, value, "tokens_per_min", integer=True, least=1)
    return Tenant(value["tenant"], admin, rate=KeyRate(rps, tpm))


def _limits(name: str, value: object, named: set[str]) -> TenantLimits:
    where = f"api_keys_file: tenant {name!r}"
    if name not in named:
        raise ValueError(f"{where}: no key belongs to this tenant")
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {value!r}")
    _known(where, value, TENANT_FIELDS)
    return TenantLimits(*(_number(where, value, f, integer=True, least=0)
                          for f in TENANT_FIELDS))


def _known(where: str, value: dict[str, Any], fields: tuple[str, ...]) -> None:
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; expected one of "
                         f"{list(fields)}")


def _number(where: str, value: dict[str, Any], field: str, *, integer: bool, least: float,
            open_low: bool = False) -> Any:
    """``value[field]`` checked: absent or null is ``None``."""
    got = value.get(field)
    if got is None:
        return None
    kinds = (int,) if integer else (int, float)
    ok = isinstance(got, kinds) and not isinstance(got, bool) and math.isfinite(got) \
        and (got > least if open_low else got >= least)
    if not ok:
        bound = f"> {least}" if open_low else f">= {least}"
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{where}: {field}: expected {kind} {bound}, got {got!r}")
    return got
