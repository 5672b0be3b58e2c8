"""What a storage batch must look like: keys, pools, pages, and the chain around them.

Shared by the local backends and the sharded client, so both refuse the same bad input
with the same ``ValueError`` before anything is stored or sent.

The chain check is per operation, not per pool. The operation's keys are its longest key
list (the KV pool's); a pool derived from KV covers the same keys, a sidecar pool (the
recurrent state of a hybrid model, a sliding window) may cover only a trailing run of them,
and its priors are the operation's priors at those positions::

    operation  k0  k1  k2  k3       priors  p   k0  k1  k2     (p: prefix_keys[-1] or seed)
    kv         k0  k1  k2  k3       start 0
    state                  k3       start 3, prior k2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pd_cache.core.hashing import DIGEST_SIZES, from_hex
from pd_cache.storage.base import (
    ExtraInfo,
    PoolHits,
    PoolRun,
    PoolTransfer,
    pool_start,
    usable_end,
)
from pd_cache.storage.record import PageRecord, check_pool_name, payload_problem


class Batch(NamedTuple):
    """One transfer, checked: keys as bytes and the expected prior of each key.

    ``start``: where ``keys`` begin in the operation's keys (``0`` but for a sidecar).
    """

    pool: str
    keys: list[bytes]
    priors: list[bytes | None]
    pages: list[PageRecord] | None
    start: int = 0


def normalize_key(key: Any, algo: str, field: str) -> bytes:
    """A page name as bytes: ``bytes`` of the digest size, or its lowercase hex text."""
    size = DIGEST_SIZES[algo]
    if isinstance(key, str):
        try:
            return from_hex(key, algo)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
    if not isinstance(key, bytes):
        raise ValueError(f"{field}: expected bytes or hex str, got {type(key).__name__}")
    if len(key) != size:
        raise ValueError(f"{field}: {len(key)} bytes, expected {size} for {algo}: {key!r}")
    return key


def normalize_keys(keys: Any, algo: str, field: str = "keys") -> list[bytes]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ValueError(f"{field}: expected a sequence of page names, got "
                         f"{type(keys).__name__}")
    return [normalize_key(k, algo, f"{field}[{i}]") for i, k in enumerate(keys)]


def expected_priors(keys: list[bytes], info: ExtraInfo | None,
                    algo: str) -> list[bytes | None]:
    """The prior each key must have, per ``info.prefix_keys``; ``None`` where unknown.

    ``None`` (feature off) checks nothing; ``[]`` starts at ``info.namespace_seed`` (if
    given); non-empty starts at its last name. Within the batch, each key follows the last.
    """
    if info is None or info.prefix_keys is None or not keys:
        return [None] * len(keys)
    prefix = normalize_keys(info.prefix_keys, algo, "extra_info.prefix_keys")
    if prefix:
        first: bytes | None = prefix[-1]
    elif info.namespace_seed is not None:
        first = normalize_key(info.namespace_seed, algo, "extra_info.namespace_seed")
    else:
        first = None
    return [first, *keys[:-1]]


def check_batch(transfers: Sequence[PoolTransfer], info: ExtraInfo | None, algo: str, *,
                with_pages: bool) -> list[Batch]:
    """Check every transfer of a v2 call; ``ValueError`` on the first problem.

    With the chain check on (``info.prefix_keys`` not ``None``), a pool whose keys are not
    a trailing run of the operation's keys is a ``ValueError`` naming it.
    """
    if isinstance(transfers, PoolTransfer) or not isinstance(transfers, Sequence):
        raise ValueError(f"transfers: expected a sequence of PoolTransfer, got "
                         f"{type(transfers).__name__}")
    if info is not None and not isinstance(info, ExtraInfo):
        raise ValueError(f"extra_info: expected ExtraInfo or None, got {type(info).__name__}")
    batches, seen = [], set()
    for j, t in enumerate(transfers):
        batch = _check_transfer(t, algo, with_pages, f"transfers[{j}]")
        if batch.pool in seen:
            raise ValueError(f"transfers[{j}].pool: {batch.pool!r} appears twice")
        seen.add(batch.pool)
        batches.append(batch)
    if not batches:
        return []
    op = max(batches, key=lambda b: len(b.keys))  # the first of the longest
    # NOTE: a shard gets its priors from the client: the prefix is not read again there.
    derive = any(t.priors is None for t in transfers)
    priors = expected_priors(op.keys, info, algo) if derive else []
    chained = info is not None and info.prefix_keys is not None
    return [_align(b, t.priors is not None, op, priors, chained, f"transfers[{j}]")
            for j, (b, t) in enumerate(zip(batches, transfers))]


def usable_hits(batches: Sequence[Batch], per_pool: dict[str, int],
                checkpoints: dict[str, list[bool]]) -> PoolHits:
    """``per_pool`` hits (from each pool's first key), ``checkpoints`` (which keys of each
    checkpoint pool are stored) and the pages usable whole (:func:`usable_end`)."""
    runs = [PoolRun(b.pool, b.start, checkpoints[b.pool] if b.pool in checkpoints
                    else [True] * per_pool[b.pool] + [False]) for b in batches]
    usable = usable_end(max(len(b.keys) for b in batches), runs)
    return PoolHits(per_pool, usable, checkpoints or None)


def _align(b: Batch, given: bool, op: Batch, op_priors: list[bytes | None], chained: bool,
           field: str) -> Batch:
    """``b`` placed in the operation: its start and, unless ``given``, its expected priors.

    Without a chain check any key list is accepted, and one that is not a trailing run
    counts from the operation's first key.
    """
    start = 0 if b is op else pool_start(op.keys, b.keys)
    if chained and start is None:
        raise ValueError(f"{field}.keys: pool {b.pool!r} covers {len(b.keys)} keys that are "
                         f"not the trailing keys of the operation's {len(op.keys)} (pool "
                         f"{op.pool!r}); a sidecar pool may only cover the last pages")
    start = start or 0
    if given:
        return b._replace(start=start)
    return b._replace(priors=op_priors[start:start + len(b.keys)], start=start)


def _check_transfer(t: Any, algo: str, with_pages: bool, field: str) -> Batch:
    """``t`` checked on its own; ``priors`` are the transfer's (empty if it gives none)."""
    if not isinstance(t, PoolTransfer):
        raise ValueError(f"{field}: expected a PoolTransfer, got {type(t).__name__}")
    pool = check_pool_name(t.pool, f"{field}.pool")
    keys = normalize_keys(t.keys, algo, f"{field}.keys")
    priors = _given_priors(t, keys, algo, field)
    pages = _check_pages(t.pages, len(keys), f"{field}.pages") if with_pages else None
    return Batch(pool, keys, priors, pages)


def _given_priors(t: PoolTransfer, keys: list[bytes], algo: str,
                  field: str) -> list[bytes | None]:
    if t.priors is None:
        return []
    if len(t.priors) != len(keys):
        raise ValueError(f"{field}.priors: {len(t.priors)} priors for {len(keys)} keys")
    return [None if p is None else normalize_key(p, algo, f"{field}.priors[{i}]")
            for i, p in enumerate(t.priors)]


def _check_pages(pages: Any, n: int, field: str) -> list[PageRecord]:
    if pages is None or isinstance(pages, (str, bytes)) or not isinstance(pages, Sequence):
        raise ValueError(f"{field}: expected a sequence of PageRecord, got "
                         f"{type(pages).__name__}")
    if len(pages) != n:
        raise ValueError(f"{field}: {len(pages)} pages for {n} keys")
    for i, page in enumerate(pages):
        if not isinstance(page, PageRecord):
            raise ValueError(f"{field}[{i}]: expected a PageRecord, got {type(page).__name__}")
        problem = payload_problem(page)
        if problem:
            raise ValueError(f"{field}[{i}]: {problem}")
    return list(pages)
