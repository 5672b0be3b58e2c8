"""The keys that seal L3 records: derived per tenant and key version from one server secret.

::

    key(tenant, version, epoch) = HKDF-SHA256(secret, salt="pd-cache/l3-seal/v1",
                                  info=u32le(len(tenant)) || utf8(tenant) || u32le(version)
                                       || u32le(epoch), length=32)
    owner(tenant)               = HMAC-SHA256(secret, "pd-cache/l3-owner" || 0x00 || tenant)[:16]

``version`` is the cluster's key version (``rotate`` starts a new one for new writes; the
older ones stay readable until ``retire``); ``epoch`` counts a tenant's purges, so a purge
makes every record the tenant had unreadable at once. ``owner`` is an opaque label a store
may see (it finds a purged tenant's records by it), not the tenant's name.

The secret is the one tenant salts use (``PD_CACHE_SECRET_FILE``); a cluster without one
draws a random secret at start, and the records it wrote are unreadable after it ends.
Only workers hold a :class:`Keyring`: storage actors never do.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import struct
from pathlib import Path
from typing import NamedTuple

import msgspec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_ENV = "PD_CACHE_SECRET_FILE"
SECRET_BYTES = 32       # what a new secret gets
MIN_SECRET_BYTES = 16   # what a given one must have
_SALT = b"pd-cache/l3-seal/v1"
_OWNER = b"pd-cache/l3-owner\x00"
_U32 = struct.Struct("<I")


class KeyId(NamedTuple):
    """Which key sealed a record: the cluster's key version and the tenant's purge epoch."""

    version: int
    epoch: int


class KeyState(msgspec.Struct, frozen=True, gc=False):
    """What a cluster's workers agree on: the version new writes use, the oldest version
    still readable, and each purged tenant's epoch (absent: 0)."""

    version: int = 1
    oldest: int = 1
    epochs: dict[str, int] = {}

    def __post_init__(self) -> None:
        if not 1 <= self.oldest <= self.version:
            raise ValueError(f"keys: expected 1 <= oldest <= version, got oldest="
                             f"{self.oldest}, version={self.version}")

    def rotated(self) -> KeyState:
        return KeyState(self.version + 1, self.oldest, self.epochs)

    def retired(self) -> KeyState:
        """Every version but the current one retired."""
        return KeyState(self.version, self.version, self.epochs)

    def purged(self, tenant: str) -> KeyState:
        return KeyState(self.version, self.oldest,
                        {**self.epochs, tenant: self.epochs.get(tenant, 0) + 1})


class Keyring:
    """A worker's keys: derives them from ``secret`` and knows which ones are readable."""

    def __init__(self, secret: bytes, state: KeyState | None = None,
                 name: str | None = None) -> None:
        """``name``: where the cluster keeps its key state for workers that restart
        (``pd_cache.worker.key_state``; ``None``: nowhere)."""
        self._secret = checked_secret(secret)
        self.state = state or KeyState()
        self.name = name

    @classmethod
    def random(cls) -> Keyring:
        """A keyring no other process can rebuild (open mode, no secret file)."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    def __repr__(self) -> str:
        return f"Keyring(version={self.state.version}, oldest={self.state.oldest})"

    def current(self, tenant: str) -> KeyId:
        """The key that seals ``tenant``'s new records."""
        return KeyId(self.state.version, self.state.epochs.get(tenant, 0))

    def readable(self, tenant: str, key: KeyId) -> bool:
        """Whether records sealed under ``key`` may still be opened for ``tenant``."""
        state = self.state
        return state.oldest <= key.version <= state.version \
            and key.epoch == state.epochs.get(tenant, 0)

    def key(self, tenant: str, key: KeyId) -> bytes:
        return _derive(self._secret, tenant, key.version, key.epoch)

    def owner(self, tenant: str) -> bytes:
        return _owner(self._secret, tenant)


def checked_secret(secret: object) -> bytes:
    """``secret`` if it is bytes of at least ``MIN_SECRET_BYTES``, else ``ValueError``: the
    one check for every key derived from the server secret (namespace salts, L3 keys)."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret: expected at least {MIN_SECRET_BYTES} bytes")
    return secret


@functools.lru_cache(maxsize=1024)
def _derive(secret: bytes, tenant: str, version: int, epoch: int) -> bytes:
    name = tenant.encode()
    info = _U32.pack(len(name)) + name + _U32.pack(version) + _U32.pack(epoch)
    return HKDF(hashes.SHA256(), 32, _SALT, info).derive(secret)


@functools.lru_cache(maxsize=1024)
def _owner(secret: bytes, tenant: str) -> bytes:
    return hmac.new(secret, _OWNER + tenant.encode(), hashlib.sha256).digest()[:16]


def read_or_create_secret(path: Path) -> bytes:
    """The secret in ``path``; a new random one, written 0600, if the file is absent."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        text = path.read_text().strip()
        try:
            return checked_secret(bytes.fromhex(text))
        except ValueError as e:
            raise ValueError(f"secret file {path}: expected at least {MIN_SECRET_BYTES} "
                             f"bytes in hex") from e
    secret = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def cluster_keyring(secret: bytes | None = None, name: str | None = None) -> Keyring:
    """The keyring a cluster starts with: ``secret``, else ``PD_CACHE_SECRET_FILE``'s
    (created when absent), else a random one (records unreadable once the cluster ends);
    its state kept under ``name``."""
    if secret is None and os.environ.get(SECRET_ENV):
        secret = read_or_create_secret(Path(os.environ[SECRET_ENV]))
    return Keyring(secret or secrets.token_bytes(SECRET_BYTES), name=name)
