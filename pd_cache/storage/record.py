"""Page records: what L3 stores under one page name.

    record = RecordHeader (msgspec) + one payload tensor per pool, in ``header.pools`` order

The header carries the page's identity (layout fingerprint, name, prior, hash algo, the
producing request's namespace seed) and each pool's dtype, shape and xxh3-64 checksum; a
sealed record (:class:`Seal`) has ciphertext payloads, no checksums, and never token ids.
The writer checks ``name == H(prior || u32le(tokens))`` (:func:`make_record`); the reader
checks the name against its own request's tokens (:func:`verify` with ``tokens``); the
tier, which has no tokens, checks everything else.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import xxhash

from pd_cache.core.config import KVLayout
from pd_cache.core.hashing import DIGEST_SIZES, page_hashes, token_buffer

RECORD_VERSION = 4   # 2: the producer's namespace seed; 3: no token ids; 4: sealed
KV_POOL = "kv"
STATE_POOL = "state"   # a hybrid model's recurrent state after the page (checkpoints only)
# Pools whose entry is a checkpoint taken after its page: a prefix is usable only if it
# ends at a page whose checkpoint is stored (the other pools hold every page's data).
CHECKPOINT_POOLS = frozenset({STATE_POOL})
DTYPES: dict[str, torch.dtype] = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.uint8)}
# NOTE: pool names end up in file names (disk backend), so they stay plain identifiers.
_POOL_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


class PoolEntry(msgspec.Struct, frozen=True, gc=False):
    """One pool's payload as the header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: int  # xxh3_64 of the payload's bytes (C order)


class Seal(msgspec.Struct, frozen=True, gc=False):
    """A sealed record's key (key version, tenant's purge epoch), owner label and nonce per
    pool (``pd_cache.storage.seal``); payloads are ``uint8[stored_nbytes]``."""
    version: int
    epoch: int
    owner: bytes
    nonces: tuple[bytes, ...]


class RecordHeader(msgspec.Struct, frozen=True, gc=False):
    version: int
    fingerprint: str
    algo: str
    name: bytes
    prior: bytes
    pools: tuple[PoolEntry, ...]
    seed: bytes = b""   # namespace seed of the producing request; readers compare their own
    seal: Seal | None = None


@dataclass(frozen=True, slots=True, eq=False)
class PageRecord:
    """A header plus its payload tensors (CPU, one per ``header.pools`` entry).

    Records handed out by a backend or received through Ray may be views of memory the
    store or the object store owns: treat payloads as read-only and copy them into your
    own pool. Pickling sends payloads as ``uint8`` numpy views, which Ray moves zero-copy.
    """

    header: RecordHeader
    payloads: tuple[torch.Tensor, ...]

    @property
    def name(self) -> bytes:
        return self.header.name

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payloads)

    def payload(self, pool: str = KV_POOL) -> torch.Tensor:
        for entry, tensor in zip(self.header.pools, self.payloads):
            if entry.name == pool:
                return tensor
        raise KeyError(f"pool {pool!r} not in record (has {self.pool_names})")

    @property
    def pool_names(self) -> list[str]:
        return [e.name for e in self.header.pools]

    def __reduce__(self) -> tuple[Any, ...]:
        return rebuild, (self.header, tuple(as_bytes(t) for t in self.payloads))


def rebuild(header: RecordHeader, arrays: tuple[np.ndarray, ...]) -> PageRecord:
    with warnings.catch_warnings():
        # NOTE: arrays from the object store are read-only; torch warns but shares them.
        warnings.simplefilter("ignore", UserWarning)
        raw = [torch.from_numpy(a) for a in arrays]
    return PageRecord(header, tuple(typed(t, e, header.seal is not None)
                                    for t, e in zip(raw, header.pools)))


def typed(raw: torch.Tensor, entry: PoolEntry, sealed: bool = False) -> torch.Tensor:
    """A stored payload's bytes as ``entry`` describes them (sealed: as they are)."""
    try:
        return raw if sealed else raw.view(DTYPES[entry.dtype]).view(entry.shape)
    except (KeyError, RuntimeError):
        return raw  # a header that disagrees with its bytes; verify() reports it


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat ``uint8`` numpy view (a copy only if not contiguous)."""
    if tensor.requires_grad or tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.detach().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()


def checksum(tensor: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(as_bytes(tensor)))


TAG_BYTES = 16   # an AEAD tag, after each sealed payload's ciphertext


def stored_nbytes(entry: PoolEntry, sealed: bool = False) -> int:
    """Bytes of ``entry``'s payload: its plaintext's, plus the tag when sealed (-1: bad)."""
    if entry.dtype not in DTYPES or any(d < 0 for d in entry.shape):
        return -1
    return DTYPES[entry.dtype].itemsize * math.prod(entry.shape) + TAG_BYTES * sealed


def check_pool_name(pool: Any, field: str = "pool") -> str:
    if not isinstance(pool, str) or not _POOL_NAME.fullmatch(pool):
        raise ValueError(f"{field}: expected 1-64 characters of [A-Za-z0-9_], got {pool!r}")
    return pool


def make_record(name: bytes, prior: bytes, tokens: Any, pools: Mapping[str, torch.Tensor], *,
                fingerprint: str, algo: str = "xxh3_128", seed: bytes = b"",
                sums: bool = True) -> PageRecord:
    """Build the record of one page; checksums are computed here, from the payloads.

    ``tokens`` are the page's token ids: ``name`` must be ``H(prior || u32le(tokens))``
    (a ``ValueError`` naming it otherwise), and they are not stored. ``seed`` is the
    namespace seed of the request that produced the page (a reader refuses a record whose
    seed is not its own request's). Payloads are referenced, not copied: do not modify them
    before they are stored. ``sums=False`` leaves every checksum 0: for a record that is
    sealed next (its tag covers the bytes; no pass over them here).
    """
    size = DIGEST_SIZES.get(algo)
    if size is None:
        raise ValueError(f"algo: unknown hash algorithm {algo!r}")
    for field, value in (("name", name), ("prior", prior)):
        if not isinstance(value, bytes) or len(value) != size:
            raise ValueError(f"{field}: expected {size} bytes of {algo}, got {value!r}")
    buf = token_buffer(tokens)
    if not len(buf):
        raise ValueError("tokens: a page has at least one token")
    if page_hashes(buf, len(buf), prior=prior, algo=algo) != [name]:
        raise ValueError(f"name: {name.hex()} is not H(prior || tokens) for prior "
                         f"{prior.hex()} and these {len(buf)} tokens")
    if not pools:
        raise ValueError("pools: a record has at least one payload")
    entries, payloads = [], []
    for pool, tensor in pools.items():
        check_pool_name(pool, "pools")
        tensor = _check_tensor(tensor, f"pools[{pool!r}]")
        entries.append(PoolEntry(pool, _dtype_name(tensor), tuple(tensor.shape),
                                 checksum(tensor) if sums else 0))
        payloads.append(tensor)
    if not isinstance(seed, bytes):
        raise ValueError(f"seed: expected bytes, got {type(seed).__name__}")
    header = RecordHeader(RECORD_VERSION, fingerprint, algo, name, prior, tuple(entries), seed)
    return PageRecord(header, tuple(payloads))


def _check_tensor(tensor: Any, field: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{field}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{field}: expected a CPU tensor, got device {tensor.device}")
    if _dtype_name(tensor) not in DTYPES:
        raise ValueError(f"{field}: dtype {tensor.dtype} is not one of {sorted(DTYPES)}")
    return tensor.detach().contiguous()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def payload_problem(record: PageRecord) -> str | None:
    """What is structurally wrong between a record's payloads and its header, if anything."""
    entries = record.header.pools
    if len(entries) != len(record.payloads):
        return f"{len(record.payloads)} payloads for {len(entries)} pool entries"
    if len({e.name for e in entries}) != len(entries):
        return "duplicate pool names"
    seal = record.header.seal
    if seal is not None and len(seal.nonces) != len(entries):
        return f"{len(seal.nonces)} nonces for {len(entries)} pool entries"
    for entry, tensor in zip(entries, record.payloads):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return f"pool {entry.name!r}: payload is not a CPU tensor"
        if seal is not None:
            if tensor.dtype != torch.uint8 or tensor.shape != (stored_nbytes(entry, True),):
                return f"pool {entry.name!r}: sealed payload of {tensor.numel()} bytes"
        elif _dtype_name(tensor) != entry.dtype:
            return f"pool {entry.name!r}: payload dtype {tensor.dtype}, header says {entry.dtype}"
        elif tuple(tensor.shape) != tuple(entry.shape):
            return (f"pool {entry.name!r}: payload shape {tuple(tensor.shape)}, header says "
                    f"{tuple(entry.shape)}")
    return None


def verify(record: PageRecord, layout: KVLayout, algo: str, *, name: bytes,
           prior: bytes | None = None, pool: str | None = None,
           tokens: Any = None, checksums_done: bool = False) -> str | None:
    """Why ``record`` is not the page ``name`` of ``layout`` (``None`` when it is).

    Cheapest first: version, fingerprint, algo, name, ``prior`` (when known), ``pool``,
    the ``kv`` (hybrid: ``state``) pool against the layout, payloads against the header,
    with ``tokens`` (the reader's own page) ``name == H(prior || tokens)``, then every
    checksum (none for a sealed record: its reader checks tags). ``checksums_done``: from a
    ``StorageBackend`` get, which verified them on the way: all but checksums is checked.
    """
    problem = _cheap_problem(record, layout, algo, name, prior, pool)
    if problem is None and tokens is not None:
        problem = tokens_problem(record.header, layout, tokens)
    if problem or checksums_done:
        return problem
    return _checksum_problems([record], [None], checksums)[0]


Checksums = Callable[[list[torch.Tensor]], list[int]]


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    return [checksum(t) for t in tensors]


def verify_all(records: Sequence[PageRecord], names: Sequence[bytes],
               priors: Sequence[bytes | None], layout: KVLayout, algo: str, *,
               pool: str | None = None, hash_all: Checksums = checksums) -> list[str | None]:
    """:func:`verify` (without ``tokens``) of several records: why each one is not its
    page, ``None`` for each that is. Every checksum of the records that passed the cheap
    checks is computed in one ``hash_all`` call, which may spread them over threads."""
    problems = [_cheap_problem(r, layout, algo, n, p, pool)
                for r, n, p in zip(records, names, priors)]
    return _checksum_problems(records, problems, hash_all)


def _cheap_problem(record: PageRecord, layout: KVLayout, algo: str, name: bytes,
                   prior: bytes | None, pool: str | None) -> str | None:
    return header_problem(record.header, layout, algo, name, prior, pool) \
        or payload_problem(record)


def _checksum_problems(records: Sequence[PageRecord], problems: list[str | None],
                       hash_all: Checksums) -> list[str | None]:
    """``problems``, with a checksum mismatch for each record still without one."""
    # NOTE: a sealed record has no checksums: its reader checks the tag as it opens it.
    todo = [(k, entry, tensor) for k, r in enumerate(records)
            if problems[k] is None and r.header.seal is None
            for entry, tensor in zip(r.header.pools, r.payloads)]
    sums = hash_all([tensor for _, _, tensor in todo]) if todo else []
    for (k, entry, _), got in zip(todo, sums):
        if got != entry.checksum and problems[k] is None:
            problems[k] = f"pool {entry.name!r}: checksum mismatch"
    return problems


def header_problem(h: RecordHeader, layout: KVLayout, algo: str, name: bytes,
                   prior: bytes | None = None, pool: str | None = None) -> str | None:
    """The part of :func:`verify` that needs only the header (cheap; no payload bytes)."""
    if h.version != RECORD_VERSION:
        return f"record version {h.version}, expected {RECORD_VERSION}"
    if h.fingerprint != layout.fingerprint:
        return f"layout fingerprint {h.fingerprint}, expected {layout.fingerprint}"
    size = DIGEST_SIZES.get(h.algo)
    if h.algo != algo or len(h.prior) != size or len(h.name) != size:
        return f"algo {h.algo!r}, expected {algo!r}"
    if h.name != name:
        return f"record names {h.name.hex()}, asked for {name.hex()}"
    if prior is not None and h.prior != prior:
        return f"prior {h.prior.hex()}, expected {prior.hex()}"
    names = [e.name for e in h.pools]
    if pool is not None and pool not in names:
        return f"pool {pool!r} not in record (has {names})"
    return _layout_problem(h, layout)


def tokens_problem(h: RecordHeader, layout: KVLayout, tokens: Any) -> str | None:
    """Why ``h`` does not name the page of ``tokens`` (the reader's own), if it does not."""
    try:
        buf = token_buffer(tokens)
    except ValueError as e:
        return f"reader's {e}"
    if len(buf) != layout.page_size:
        return f"{len(buf)} token ids, expected {layout.page_size}"
    if page_hashes(buf, len(buf), prior=h.prior, algo=h.algo) != [h.name]:
        return "name is not H(prior || tokens) for the reader's tokens"
    return None


def _layout_problem(h: RecordHeader, layout: KVLayout) -> str | None:
    """A ``kv`` payload, or a hybrid layout's ``state`` payload, that is not the layout's.

    (A plain layout has no recurrent state: there ``state`` is a sidecar like any other.)
    """
    want = {KV_POOL: (layout.kv_dtype, layout.page_shape)}
    if layout.has_state:
        want[STATE_POOL] = ("float32", layout.state_shape)
    for entry in h.pools:
        if entry.name in want and (entry.dtype, tuple(entry.shape)) != want[entry.name]:
            dtype, shape = want[entry.name]
            return (f"{entry.name} pool {entry.dtype}{list(entry.shape)}, layout says "
                    f"{dtype}{list(shape)}")
    return None


def encode_header(header: RecordHeader) -> bytes:
    return msgspec.msgpack.encode(header)


def decode_header(raw: bytes) -> RecordHeader:
    """Parse a header; a ``ValueError`` for bytes that are not one."""
    try:
        return msgspec.msgpack.decode(raw, type=RecordHeader)
    except msgspec.DecodeError as e:
        raise ValueError(f"record header: {e}") from None
