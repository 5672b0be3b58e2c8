"""Tenants the server vouches for: API keys, and the namespace salt derived from them.

The key file (``pd_cache.front.keyfile``) maps each key to its tenant (and the key's rate
limits, the tenant's quotas). With keys, every request needs ``Authorization: Bearer <key>``,
and its ``cache_salt`` is the server's, never the client's::

    cache_salt = hex(HMAC-SHA256(secret, utf8(tenant) || 0x00 || utf8(client_salt or "")))

so a client's own ``cache_salt`` only subdivides its tenant. The secret lives in a file
(``PD_CACHE_SECRET_FILE``, default beside the key file as ``<keys>.secret``), created 0600
on first start, so a restart keeps every tenant's L3 pages reachable. Without a key file
the server is open: the client's ``cache_salt`` is used as given, and the server serves
loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from pd_cache.core.sealing import SECRET_ENV, checked_secret, read_or_create_secret
from pd_cache.front.keyfile import Tenant, TenantLimits, parse_key_file

KEYS_ENV = "PD_CACHE_API_KEYS_FILE"


class Unauthorized(Exception):
    """No key, or a key the server does not know (HTTP 401)."""


class Tenants:
    """API key -> tenant, and the secret that turns a tenant into its namespace salt."""

    def __init__(self, keys: dict[str, Tenant], secret: bytes,
                 limits: dict[str, TenantLimits] | None = None) -> None:
        # NOTE: look keys up by their digest so the table holds no key in clear; a key's
        # rate bucket is named by another digest prefix, which reveals nothing either.
        self._by_digest = {_digest(k): t._replace(key_id=_digest(k).hex()[:16])
                           for k, t in keys.items()}
        self._secret = checked_secret(secret)
        self.limits = dict(limits or {})

    @property
    def names(self) -> tuple[str, ...]:
        """Every tenant of the key file, sorted: the only values a tenant label takes."""
        return tuple(sorted({t.name for t in self._by_digest.values()}))

    @property
    def secret(self) -> bytes:
        """The server secret: the cluster's L3 keys derive from it too (core.sealing)."""
        return self._secret

    @classmethod
    def from_file(cls, keys_file: str | os.PathLike[str],
                  secret_file: str | os.PathLike[str] | None = None) -> Tenants:
        """Read the key file; read (or create, 0600) the secret file."""
        path = Path(keys_file)
        parsed = parse_key_file(path)
        secret_path = Path(secret_file or os.environ.get(SECRET_ENV)
                           or path.with_name(path.name + ".secret"))
        return cls(parsed.keys, read_or_create_secret(secret_path), parsed.tenants)

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header; ``Unauthorized``."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        tenant = self._by_digest.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthorized("unknown API key")
        return tenant

    def cache_salt(self, tenant: Tenant, client_salt: str | None) -> str:
        """The namespace salt of ``tenant``, subdivided by the client's own salt."""
        message = tenant.name.encode() + b"\x00" + (client_salt or "").encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()




def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
