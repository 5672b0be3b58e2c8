"""What a local backend's index keeps per record, and the small results its writes name."""

from __future__ import annotations

import errno
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


def key_of(header: RecordHeader) -> tuple[int, int, bytes] | None:
    """The key a record was sealed under (``None``: not sealed): a record sealed under
    another one (rotated, purged, another secret) replaces a stored one of its name."""
    seal = header.seal
    return None if seal is None else (seal.version, seal.epoch, seal.owner)
