"""Sealed records: every payload encrypted and authenticated in the worker that writes it.

::

    writer: header' = header + Seal(key version, tenant epoch, owner, nonce per pool)
            payload' = AEAD(key(tenant, version, epoch), nonce, payload, aad=msgpack(header'))
    store:  keeps header' and ciphertext; checks shapes (it holds no key)
    reader: the owner is its tenant's, the key still readable, then AEAD open (the tag
            covers the bytes and the whole header: a relabelled record fails it)

The tag replaces the payload checksums (a sealed record carries none): the one pass over
the bytes is the cipher's. A record that fails to open is a verified miss, counted here.
Nonces are a per-:class:`Sealer` random 8-byte prefix and a 4-byte counter (a new prefix
before the counter wraps), so no nonce repeats under a key. The AEAD is AES-256-GCM or
ChaCha20-Poly1305 (``AEAD``: whichever ``benchmarks/bench_storage.py`` measures faster).
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from pd_cache.core.sealing import KeyId, Keyring
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.base import (
    ExtraInfo,
    Pending,
    PoolHits,
    PoolTransfer,
    StorageBackend,
    SubmittedBackend,
    Usage,
)
from pd_cache.storage.record import TAG_BYTES, PageRecord, Seal, as_bytes, encode_header, typed

log = logging.getLogger(__name__)

AEADS: dict[str, Any] = {"aes-256-gcm": AESGCM, "chacha20-poly1305": ChaCha20Poly1305}
AEAD = "aes-256-gcm"
_COUNTER = struct.Struct(">I")


class Opened(NamedTuple):
    """A record opened (``record``, its header without the seal) or why not (``reason``)."""

    record: PageRecord | None
    reason: MissReason | None = None
    detail: str = ""


class Sealer:
    """Seals and opens records with ``keyring``'s keys; ``enabled=False`` (a benchmark's
    unsealed baseline) passes records through both ways and opens only unsealed ones."""

    def __init__(self, keyring: Keyring, *, enabled: bool = True, aead: str = AEAD) -> None:
        if aead not in AEADS:
            raise ValueError(f"aead: expected one of {sorted(AEADS)}, got {aead!r}")
        self.keyring, self.enabled, self.aead = keyring, enabled, aead
        self._lock = threading.Lock()
        self._prefix, self._count = os.urandom(8), 0

    def _nonce(self) -> bytes:
        with self._lock:
            if self._count == 0xFFFFFFFF:
                self._prefix, self._count = os.urandom(8), 0
            self._count += 1
            return self._prefix + _COUNTER.pack(self._count)

    def seal(self, record: PageRecord, tenant: str) -> PageRecord:
        """``record`` sealed under ``tenant``'s current key (itself when disabled)."""
        if not self.enabled:
            return record
        key = self.keyring.current(tenant)
        nonces = tuple(self._nonce() for _ in record.payloads)
        seal = Seal(key.version, key.epoch, self.keyring.owner(tenant), nonces)
        header = msgspec.structs.replace(record.header, seal=seal)
        aad, secret = encode_header(header), self.keyring.key(tenant, key)
        seal_one = _gcm_seal if self.aead == "aes-256-gcm" else _aead_seal(self.aead)
        return PageRecord(header, tuple(seal_one(secret, n, as_bytes(t), aad)
                                        for n, t in zip(nonces, record.payloads)))

    def open(self, record: PageRecord, tenant: str) -> Opened:
        """``record``'s plaintext if ``tenant`` may read it and every tag verifies."""
        seal = record.header.seal
        if not self.enabled or seal is None:
            if self.enabled or seal is not None:
                return Opened(None, MissReason.VERIFICATION_FAILED,
                              "unsealed record" if seal is None else "sealed record")
            return Opened(record)
        key = KeyId(seal.version, seal.epoch)
        if seal.owner != self.keyring.owner(tenant):
            return Opened(None, MissReason.VERIFICATION_FAILED, "another tenant's record")
        if not self.keyring.readable(tenant, key):
            return Opened(None, MissReason.KEY_RETIRED, f"key {tuple(key)} retired")
        aad, secret = encode_header(record.header), self.keyring.key(tenant, key)
        open_one = _gcm_open if self.aead == "aes-256-gcm" else _aead_open(self.aead)
        try:
            plain = [typed(open_one(secret, n, as_bytes(t), aad), e)
                     for n, t, e in zip(seal.nonces, record.payloads, record.header.pools)]
        except InvalidTag:
            return Opened(None, MissReason.VERIFICATION_FAILED, "tag does not verify")
        return Opened(PageRecord(msgspec.structs.replace(record.header, seal=None),
                                 tuple(plain)))


# NOTE: AES-GCM through the streaming interface, into a buffer of our own: here ~7 GB/s,
# where the one-shot AESGCM (a new bytes object per call) ran at ~1 GB/s.
def _gcm_seal(key: bytes, nonce: bytes, data: np.ndarray, aad: bytes) -> torch.Tensor:
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    out = torch.empty(len(data) + TAG_BYTES, dtype=torch.uint8)
    view = out.numpy()
    enc.update_into(data, view[:-TAG_BYTES])
    enc.finalize()
    view[-TAG_BYTES:] = np.frombuffer(enc.tag, np.uint8)
    return out


def _gcm_open(key: bytes, nonce: bytes, data: np.ndarray, aad: bytes) -> torch.Tensor:
    """The plaintext of ``data`` (ciphertext + tag); ``InvalidTag`` if it does not verify."""
    if len(data) < TAG_BYTES:
        raise InvalidTag
    tag = data[-TAG_BYTES:].tobytes()
    dec = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
    dec.authenticate_additional_data(aad)
    out = torch.empty(len(data) - TAG_BYTES, dtype=torch.uint8)
    dec.update_into(data[:-TAG_BYTES], out.numpy())
    dec.finalize()
    return out


def _aead_seal(aead: str) -> Callable[[bytes, bytes, np.ndarray, bytes], torch.Tensor]:
    return lambda key, nonce, data, aad: _tensor(_aead(aead, key).encrypt(nonce, data, aad))


def _aead_open(aead: str) -> Callable[[bytes, bytes, np.ndarray, bytes], torch.Tensor]:
    return lambda key, nonce, data, aad: _tensor(_aead(aead, key).decrypt(nonce, data, aad))


@functools.lru_cache(maxsize=256)
def _aead(aead: str, key: bytes) -> Any:
    return AEADS[aead](key)


def _tensor(raw: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # read-only bytes, shared not copied
        return torch.from_numpy(np.frombuffer(raw, np.uint8))


class SealedStorage(SubmittedBackend):
    """A worker's view of L3 (``inner``): sets seal, gets open, in this process.

    ``ExtraInfo.tenant`` picks the key (``None``: ``""``) and is dropped before ``inner``
    sees the call. A record that does not open is a miss (``verification_failed``, or
    ``key_retired``), counted here and in ``metrics``.
    """

    checksums_in_reader = True   # the tags were checked here, on the bytes returned

    def __init__(self, inner: StorageBackend, sealer: Sealer, metrics: Any = None) -> None:
        self.inner, self.sealer, self.metrics = inner, sealer, metrics
        self.algo, self.seals = inner.algo, sealer.enabled
        self._stats = Stats()

    def submit_exists_v2(self, transfers: Sequence[PoolTransfer],
                         extra_info: ExtraInfo | None = None) -> Pending[PoolHits]:
        return self.inner.submit_exists_v2(transfers, _stripped(extra_info))

    def submit_get_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[PoolTransfer]]:
        tenant = _tenant(extra_info)
        return self.inner.submit_get_v2(transfers, _stripped(extra_info)).then(
            lambda got: [self._open_all(t, tenant) for t in got])

    def submit_set_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[list[bool]]]:
        tenant = _tenant(extra_info)
        sealed = [t if t.pages is None else msgspec.structs.replace(
            t, pages=[p if not isinstance(p, PageRecord) else self.sealer.seal(p, tenant)
                      for p in t.pages]) for t in transfers]
        return self.inner.submit_set_v2(sealed, _stripped(extra_info))

    def _open_all(self, transfer: PoolTransfer, tenant: str) -> PoolTransfer:
        pages, bad = [], []
        for key, page in zip(transfer.keys, transfer.pages or []):
            opened = None if page is None else self.sealer.open(page, tenant)
            if opened is not None and opened.reason is not None:
                log.warning("L3 record %s/%s does not open: %s", transfer.pool,
                            page.name.hex(), opened.detail)
                self._miss(opened.reason)
                seal = page.header.seal
                # NOTE: another owner's record is left alone (this reader cannot tell it
                # is bad); a set under this owner's key replaces it.
                if seal is None or seal.owner == self.sealer.keyring.owner(tenant):
                    bad.append(key)
            pages.append(None if opened is None else opened.record)
        if bad:   # NOTE: the store deletes them, so the page can be stored again
            self.inner.discard_v2(transfer.pool, bad)
        return msgspec.structs.replace(transfer, pages=pages)

    def _miss(self, reason: MissReason) -> None:
        self._stats.count(Event.MISS, reason)   # the store counts the discard
        if self.metrics is not None:
            self.metrics.count_miss(reason, 1)

    def stats(self) -> dict[str, int]:
        total = Stats()
        total.merge(self.inner.stats())
        total.merge(self._stats.snapshot())
        return total.snapshot()

    def usage(self) -> Usage:
        return self.inner.usage()


def _tenant(info: ExtraInfo | None) -> str:
    return "" if info is None or info.tenant is None else info.tenant


def _stripped(info: ExtraInfo | None) -> ExtraInfo | None:
    if info is None or info.tenant is None:
        return info
    return msgspec.structs.replace(info, tenant=None)
