"""What a local backend's index keeps per record, and the small results its writes name."""

from __future__ import annotations

import errno
from collections.abc import Container, Iterable
from itertools import chain
from typing import NamedTuple

from pd_cache.core.vocab import MissReason
from pd_cache.storage.eviction import Slot
from pd_cache.storage.record import RecordHeader


class Entry(NamedTuple):
    header: RecordHeader
    nbytes: int


class Refusal(NamedTuple):
    """Why a record indexed for a batch could not be written: counted ``refused/<reason>``."""

    reason: MissReason
    detail: str


def refusal_of(error: OSError) -> Refusal:
    """A failed write, as a refusal: a full filesystem (or quota) is ``disk_full``."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    return Refusal(MissReason.DISK_FULL if full else MissReason.STORAGE_ERROR, str(error))


class Link(NamedTuple):
    """Where a new page hangs in its chain: ``parent``, and whether that was just evicted."""

    parent: Slot
    orphan: bool


def link_of(pool: str, prior: bytes, earlier: Iterable[bytes], stored: Container[Slot],
            gone: Container[Slot]) -> Link:
    """The ``stored`` (or just evicted: ``gone``) page a new one hangs from in its chain:
    its prior, else the nearest of ``earlier`` (a shard's view of a chain has gaps)."""
    for name in chain((prior,), earlier):
        slot = (pool, name)
        if slot in stored or slot in gone:
            return Link(slot, slot not in stored)
    return Link((pool, prior), False)


def owner_of(header: RecordHeader) -> bytes | None:
    """The owner label a record was sealed for (``None``: not sealed, no quota)."""
    return None if header.seal is None else header.seal.owner


def key_of(header: RecordHeader) -> tuple[int, int, bytes] | None:
    """The key a record was sealed under (``None``: not sealed): a record sealed under
    another one (rotated, purged, another secret) replaces a stored one of its name."""
    seal = header.seal
    return None if seal is None else (seal.version, seal.epoch, seal.owner)
