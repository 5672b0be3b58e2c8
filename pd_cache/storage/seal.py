"""Sealed records: every payload encrypted and authenticated in the worker that writes it.

::

    writer: header' = header + Seal(key version, tenant epoch, owner, nonce per pool)
            payload' = AEAD(key(tenant, version, epoch), nonce, payload, aad=msgpack(header'))
    store:  keeps header' and ciphertext; checks shapes (it holds no key)
    reader: the owner is its tenant's, the key still readable, then AEAD open (the tag
            covers the bytes and the whole header: a relabelled record fails it)

The tag replaces the payload checksums (a sealed record carries none): the one pass over
the bytes is the cipher's, straight into the buffer that is stored (a set) or into the
slots the pages are read for (:meth:`SealedStorage.submit_get_into`), on both cores when
the batch is large (``pd_cache.storage.spread``). A record that fails to open is a
verified miss, counted here.
Nonces are a per-:class:`Sealer` random 8-byte prefix and a 4-byte counter (a new prefix
before the counter wraps), so no nonce repeats under a key. The AEAD is AES-256-GCM or
ChaCha20-Poly1305 (``storage.cipher.AEAD``: whichever ``benchmarks/bench_storage.py``
measures faster).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch
from cryptography.exceptions import InvalidTag

from pd_cache.core.sealing import KeyId, Keyring
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.arena_writer import ArenaWriter, Slotted, committed_all
from pd_cache.storage.base import (
    ExtraInfo,
    Pending,
    PoolHits,
    PoolTransfer,
    StorageBackend,
    SubmittedBackend,
    Usage,
)
from pd_cache.storage.cipher import AEAD, AEADS, open_into, seal_into
from pd_cache.storage.reader import Opening, count_read
from pd_cache.storage.record import (
    DTYPES,
    KV_POOL,
    TAG_BYTES,
    PageRecord,
    PoolEntry,
    Seal,
    as_bytes,
    encode_header,
    stored_nbytes,
    typed,
)
from pd_cache.storage.reopen import OpenedPages, open_each, refusal
from pd_cache.storage.spread import Spread

log = logging.getLogger(__name__)

_COUNTER = struct.Struct(">I")
SCRATCH_BYTES = 256 << 20   # the largest set a worker seals into its kept buffer
Into = Sequence[torch.Tensor | None]


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

    def _nonces(self, n: int) -> tuple[bytes, ...]:
        """``n`` nonces never handed out before by this sealer."""
        with self._lock:
            nonces = []
            for _ in range(n):
                if self._count == 0xFFFFFFFF:
                    self._prefix, self._count = os.urandom(8), 0
                self._count += 1
                nonces.append(self._prefix + _COUNTER.pack(self._count))
            return tuple(nonces)

    def seal(self, record: PageRecord, tenant: str,
             out: torch.Tensor | None = None) -> PageRecord:
        """``record`` sealed under ``tenant``'s current key (itself when disabled), into
        ``out`` (``uint8[sealed_nbytes(record)]``) when given, else new memory."""
        if not self.enabled:
            return record
        key, payloads = self.keyring.current(tenant), record.payloads
        nonces = self._nonces(len(payloads))
        seal = Seal(key.version, key.epoch, self.keyring.owner(tenant), nonces)
        header = msgspec.structs.replace(record.header, seal=seal)
        aad, secret = encode_header(header), self.keyring.key(tenant, key)
        outs = _split(out, _sealed_sizes(payloads))
        return PageRecord(header, tuple(seal_into(self.aead, secret, n, as_bytes(t), aad, o)
                                        for n, t, o in zip(nonces, payloads, outs)))

    def check(self, record: PageRecord, tenant: str) -> Opened:
        """Whether ``tenant`` may open ``record`` (its header alone: no bytes read yet)."""
        seal = record.header.seal
        if not self.enabled or seal is None:
            if self.enabled or seal is not None:
                return Opened(None, MissReason.VERIFICATION_FAILED,
                              "unsealed record" if seal is None else "sealed record")
            return Opened(record)
        if seal.owner != self.keyring.owner(tenant):
            return Opened(None, MissReason.VERIFICATION_FAILED, "another tenant's record")
        key = KeyId(seal.version, seal.epoch)
        if not self.keyring.readable(tenant, key):
            return Opened(None, MissReason.KEY_RETIRED, f"key {tuple(key)} retired")
        return Opened(record)

    def open(self, record: PageRecord, tenant: str, into: Into = ()) -> Opened:
        """``record``'s plaintext if ``tenant`` may read it and every tag verifies; each
        payload lands in its ``into`` tensor (one per pool, ``None``: new memory) when that
        is contiguous and of the payload's dtype and size (unsealed: copied there)."""
        checked = self.check(record, tenant)
        if checked.reason is not None or not (self.enabled or any(t is not None for t in into)):
            return checked
        header, targets = record.header, [_target(t, e) for t, e in
                                          zip(_padded(into, len(record.payloads)),
                                              record.header.pools)]
        if header.seal is None:   # unsealed (a benchmark's baseline): copied into place
            return Opened(PageRecord(header, tuple(
                p if t is None else _copied(p, t) for p, t in zip(record.payloads, targets))))
        seal = header.seal
        aad, secret = encode_header(header), self.keyring.key(tenant,
                                                              KeyId(seal.version, seal.epoch))
        try:
            plain = [self._open_one(secret, n, t, e, aad, d) for n, t, e, d in
                     zip(seal.nonces, record.payloads, header.pools, targets)]
        except InvalidTag:
            return Opened(None, MissReason.VERIFICATION_FAILED, "tag does not verify")
        return Opened(PageRecord(msgspec.structs.replace(header, seal=None), tuple(plain)))

    def _open_one(self, key: bytes, nonce: bytes, data: torch.Tensor, entry: PoolEntry,
                  aad: bytes, target: tuple[torch.Tensor, np.ndarray] | None) -> torch.Tensor:
        out = open_into(self.aead, key, nonce, as_bytes(data), aad,
                        None if target is None else target[1])
        return typed(torch.from_numpy(out), entry) if target is None else target[0]


def sealed_nbytes(record: PageRecord) -> int:
    """Bytes of ``record``'s payloads once sealed (each with its tag)."""
    return sum(_sealed_sizes(record.payloads))


def _sealed_sizes(payloads: Sequence[torch.Tensor]) -> list[int]:
    """Each payload's bytes once sealed: the ciphertext and its tag."""
    return [t.nbytes + TAG_BYTES for t in payloads]


def _split(out: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor | None]:
    """``out`` cut into consecutive pieces of ``sizes`` bytes (``None`` each if no ``out``)."""
    if out is None:
        return [None] * len(sizes)
    ends = list(itertools.accumulate(sizes, initial=0))
    return [out[lo:hi] for lo, hi in zip(ends, ends[1:])]


def _padded(into: Into, n: int) -> list[torch.Tensor | None]:
    return [*list(into)[:n], *[None] * max(0, n - len(into))]


def _target(dst: torch.Tensor | None,
            entry: PoolEntry) -> tuple[torch.Tensor, np.ndarray] | None:
    """``dst`` as the payload ``entry`` describes and its bytes, if a payload can land
    there as it is (contiguous, on the CPU, of that dtype and size); else ``None``."""
    if dst is None or dst.device.type != "cpu" or not dst.is_contiguous() \
            or DTYPES.get(entry.dtype) != dst.dtype \
            or dst.numel() * dst.element_size() != stored_nbytes(entry):
        return None
    return dst.view(entry.shape), dst.view(-1).view(torch.uint8).numpy()


def _copied(payload: torch.Tensor, target: tuple[torch.Tensor, np.ndarray]) -> torch.Tensor:
    if payload.shape != target[0].shape or payload.dtype != target[0].dtype:
        return payload   # the reader's checks refuse it
    return target[0].copy_(payload)


class SealedStorage(SubmittedBackend):
    """A worker's view of L3 (``inner``): sets seal, gets open, in this process.

    ``ExtraInfo.tenant`` picks the key (``None``: ``""``) and is dropped before ``inner``
    sees the call. A record that does not open is a miss (``verification_failed``, or
    ``key_retired``), counted here and in ``metrics``; over several copies it is read from
    the next (``storage.reopen``). ``scratch_bytes``: ``inner`` copies
    what a set gives it before ``submit_set_v2`` returns (the sharded client's one put per
    shard), so a set seals into one buffer of up to that many bytes, kept and reused (warm
    memory seals twice as fast as fresh); ``0``: every set seals into new memory.
    """

    checksums_in_reader = True   # the tags were checked here, on the bytes returned

    def __init__(self, inner: StorageBackend, sealer: Sealer, metrics: Any = None, *,
                 scratch_bytes: int = 0, threads: int | None = None,
                 arena: ArenaWriter | None = None) -> None:
        self.inner, self.sealer, self.metrics, self.arena = inner, sealer, metrics, arena
        self.algo, self.seals = inner.algo, sealer.enabled
        self.scratch_bytes = scratch_bytes
        self._stats = Stats()
        self._spread = Spread(threads, "pd-cache-seal")
        self._set_lock = threading.Lock()   # guards the scratch buffer until inner copied it
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def submit_exists_v2(self, transfers: Sequence[PoolTransfer],
                         extra_info: ExtraInfo | None = None) -> Pending[PoolHits]:
        return self.inner.submit_exists_v2(transfers, _stripped(extra_info))

    def submit_get_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[PoolTransfer]]:
        tenant = _tenant(extra_info)
        inner = self.inner.submit_get_v2(transfers, _stripped(extra_info))
        return Opening(inner, lambda got, faults: open_each(
            inner, got, [()] * len(got), lambda t, into: self._open_all(t, tenant, into),
            self.inner.discard_v2, faults))

    def submit_get_into(self, keys: Sequence[bytes], into: Sequence[torch.Tensor],
                        extra_info: ExtraInfo | None = None
                        ) -> Pending[list[PageRecord | None]]:
        """``submit_get`` (the ``kv`` pool) whose pages land in ``into``, one tensor of the
        page's dtype and shape per key (the host-pool slots they are read for): a record's
        payload *is* its ``into`` tensor, opened there (copied when unsealed). The bytes
        land when the result is collected; a key that misses may leave its tensor written
        (with bytes that did not verify): use only the tensors of the records returned."""
        if len(into) != len(keys):
            raise ValueError(f"into: {len(into)} tensors for {len(keys)} keys")
        tenant, transfer = _tenant(extra_info), PoolTransfer(KV_POOL, list(keys))
        inner = self.inner.submit_get_v2([transfer], _stripped(extra_info))
        return Opening(inner, lambda got, faults: list(open_each(
            inner, got, [into], lambda t, dst: self._open_all(t, tenant, dst),
            self.inner.discard_v2, faults)[0].pages or []))

    def submit_set_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[list[bool]]]:
        pages = [p for t in transfers for p in t.pages or [] if isinstance(p, PageRecord)]
        if not self.sealer.enabled or not pages:
            return self.inner.submit_set_v2(transfers, _stripped(extra_info))
        sizes = [sealed_nbytes(p) for p in pages]
        with self._set_lock:
            slots = [None] * len(pages) if self.arena is None else self.arena.grant(
                transfers, extra_info, sizes)
            sealed = iter(committed_all(
                self._seal_all(pages, _tenant(extra_info), slots, sizes), slots))
            return self.inner.submit_set_v2([t if t.pages is None else msgspec.structs.replace(
                t, pages=[next(sealed) if isinstance(p, PageRecord) else p for p in t.pages])
                for t in transfers], _stripped(extra_info))

    def _seal_all(self, pages: list[PageRecord], tenant: str,
                  slots: Sequence[Slotted | None], sizes: Sequence[int]) -> list[PageRecord]:
        """``pages`` sealed, each into its arena slot if it has one (``slots``, one per
        page), the rest into the scratch buffer when it may hold them; on the spread's
        threads when they are many bytes. ``sizes``: their sealed sizes."""
        rest = [n for n, slot in zip(sizes, slots) if slot is None]
        total = sum(sizes)
        if sum(rest) > self.scratch_bytes:
            parts: list[torch.Tensor | None] = [None] * len(rest)
        else:
            if self._scratch.numel() < sum(rest):
                self._scratch = torch.empty(sum(rest), dtype=torch.uint8)
            parts = _split(self._scratch, rest)
        free = iter(parts)
        outs = [next(free) if slot is None else slot.view(n) for n, slot in zip(sizes, slots)]
        return self._spread.map(lambda run: [self.sealer.seal(p, tenant, o) for p, o in run],
                                list(zip(pages, outs)), total)

    def _open_all(self, transfer: PoolTransfer, tenant: str, into: Into = ()) -> OpenedPages:
        """Every page of ``transfer`` opened (into ``into``'s tensors, one per key, when
        given) on the spread's threads; one that does not is counted, and marked bad (to be
        dropped, ``storage.reopen``) if it is this tenant's."""
        pages = list(transfer.pages or [])
        outs = _padded(into, len(pages))
        nbytes = sum(p.nbytes for p in pages if p is not None)
        opened = self._spread.map(
            lambda run: [None if p is None else self.sealer.open(p, tenant, (o,))
                         for p, o in run], list(zip(pages, outs)), nbytes)
        refused = [i for i, got in enumerate(opened) if got is not None and got.reason is not None]
        first = None if not refused else refusal(
            opened[refused[0]].reason or MissReason.VERIFICATION_FAILED, opened[refused[0]].detail)
        bad = [i for i in refused if self._refused(pages[i], opened[i], transfer.pool, tenant)]
        return OpenedPages(msgspec.structs.replace(
            transfer, pages=[None if got is None else got.record for got in opened]),
            refused, bad, first)

    def _refused(self, page: PageRecord, got: Opened, pool: str, tenant: str) -> bool:
        """Count a record that did not open; whether its store should discard it."""
        log.warning("L3 record %s/%s does not open: %s", pool, page.name.hex(), got.detail)
        # NOTE: the store counts the discard; the miss is this reader's
        count_read(self._stats, self.metrics, Event.MISS,
                   got.reason or MissReason.VERIFICATION_FAILED)
        seal = page.header.seal
        # NOTE: another owner's record is left alone (this reader cannot tell it is bad);
        # a set under this owner's key replaces it.
        return seal is None or seal.owner == self.sealer.keyring.owner(tenant)

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
