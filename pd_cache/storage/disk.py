"""``disk`` backend: one file per record, written atomically; survives a restart.

Layout under ``path``::

    <path>/<fingerprint[:16]>/<name[:2]>/<name hex>.<pool>.rec

File format (little-endian)::

    0   magic b"PDCR" | u32 header length | u64 xxh3_64 of the header bytes   (16 bytes)
    16  header: msgpack of RecordHeader
        zero padding; each payload starts at a multiple of 64 (dtype views stay aligned)
        payloads in header.pools order, C-contiguous bytes

A record is written to ``<file>.tmp``, fsynced, renamed over ``<file>`` and the directory
fsynced, so a file under its final name is whole once ``batch_set`` acknowledged it. At
start the index is rebuilt from the headers (leftover ``.tmp`` files, files that do not
parse, of another record version, or whose size disagrees with their header are deleted);
recency is file mtime, refreshed on every hit, and each page hangs again from its stored
prior (the links a shard made across pages held elsewhere are not kept). Payload checksums
are verified on every read.

A free-space reserve (``reserve``: a fraction of the filesystem, or bytes) is kept on the
filesystem, whoever else writes to it: before a batch is written, the least recently used
chains lose their tails until the batch fits above the reserve; a page that still would
not is refused and counted ``refused/disk_full`` (so is a write that hits ``ENOSPC``), and
a later lookup of it misses with reason ``disk_full``.

Files are private to the service's user whatever the umask: directories 0700, record
files (temporary ones included) 0600. A tree left wider by an older version is tightened
at start.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from pd_cache.core.config import KVLayout, StorageConfig
from pd_cache.core.fields import DISK_RESERVE, check_disk_reserve, disk_reserve_bytes
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.local import LocalBackend, Refusal, Slot, refusal_of
from pd_cache.storage.record import (
    PageRecord,
    RecordHeader,
    as_bytes,
    decode_header,
    encode_header,
    header_problem,
    stored_nbytes,
    typed,
)

log = logging.getLogger(__name__)

MAGIC = b"PDCR"
FRAME = struct.Struct("<4sIQ")
ALIGN = 64
SUFFIX = ".rec"
TMP = ".tmp"
DIR_MODE, FILE_MODE = 0o700, 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)   # never write a record through a planted symlink


class DiskSpace(NamedTuple):
    """A filesystem's size, the bytes an unprivileged writer may still use, its block."""

    total: int
    free: int
    block: int


class DiskBackend(LocalBackend):
    """Records as files in a directory, bounded in bytes (tails first), recovered at start.

    ``path`` is the store's own directory: it and everything under it are made private.
    """

    def __init__(self, path: str | os.PathLike[str], layout: KVLayout, capacity_bytes: int, *,
                 algo: str = "xxh3_128", fsync: bool = True,
                 reserve: float = DISK_RESERVE) -> None:
        super().__init__(layout, capacity_bytes, algo=algo)
        check_disk_reserve("reserve", reserve)
        self.reserve = reserve
        if not path:
            raise ValueError(f"path: expected a directory, got {path!r}")
        # NOTE: one subdirectory per layout, so two models sharing a path never collide.
        self.path = Path(path)
        self.root = self.path / layout.fingerprint[:16]
        _make_private_dirs(self.root)
        self.fsync = fsync
        self._tightened = sum(_tighten(d, DIR_MODE) for d in (self.path, self.root))
        self._recover()

    @classmethod
    def from_config(cls, config: StorageConfig, layout: KVLayout, *, algo: str = "xxh3_128",
                    shard: int = 0) -> DiskBackend:
        if not config.disk_path:
            raise ValueError("storage.disk_path: expected a directory for backend='disk'")
        return cls(Path(config.disk_path) / f"shard-{shard}", layout,
                   config.shard_capacity_bytes, algo=algo, reserve=config.disk_reserve)

    # -- paths ----------------------------------------------------------------------------
    def _path(self, slot: Slot) -> Path:
        text = slot[1].hex()
        return self.root / text[:2] / f"{text}.{slot[0]}{SUFFIX}"

    def _slot_of(self, path: Path) -> Slot | None:
        stem, _, pool = path.name.removesuffix(SUFFIX).partition(".")
        try:
            return pool, bytes.fromhex(stem)
        except ValueError:
            return None

    # -- bytes ----------------------------------------------------------------------------
    def _footprint(self, record: PageRecord) -> int:
        return _offsets(record.header, len(encode_header(record.header)))[1]

    def _filesystem(self) -> DiskSpace:
        st = os.statvfs(self.root)
        return DiskSpace(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, st.f_frsize)

    def _make_room(self, need: int, keep: frozenset[Slot] = frozenset()) -> tuple[int, int]:
        """Evict tails first (never one of ``keep``) until ``need`` more bytes fit above the
        reserve, or nothing else may go; the room left above it, and the reserve."""
        space = self._filesystem()
        reserve = disk_reserve_bytes(self.reserve, space.total)
        room = space.free - reserve
        if need > room:
            # NOTE: evicted bytes are counted unrounded, so at least the blocks needed go.
            self._evict_until(self._used - (need - room), keep)
            room = self._filesystem().free - reserve
        return room, reserve

    def _write_all(self, items: list[tuple[Slot, PageRecord]]) -> list[Refusal | None]:
        block = self._filesystem().block
        sizes = [_rounded(self._index[slot].nbytes, block) for slot, _ in items]
        room, reserve = self._make_room(sum(sizes), frozenset(slot for slot, _ in items))
        errors: list[Refusal | None] = []
        for (slot, record), size in zip(items, sizes):
            if size > room:
                errors.append(Refusal(MissReason.DISK_FULL, f"{max(room, 0)} bytes free above "
                                      f"the reserve of {reserve} on {self.path}"))
                continue
            try:
                self._write(slot, record)
                room -= size
                errors.append(None)
            except OSError as e:
                errors.append(refusal_of(e))
        return errors

    def _write(self, slot: Slot, record: PageRecord) -> None:
        path = self._path(slot)
        _make_private_dirs(path.parent)
        tmp = path.with_name(path.name + TMP)
        try:
            self._write_file(tmp, record)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync_dir(path.parent)

    def _write_file(self, tmp: Path, record: PageRecord) -> None:
        header = encode_header(record.header)
        offsets, _ = _offsets(record.header, len(header))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, FILE_MODE)
        with open(fd, "wb") as f:
            os.fchmod(fd, FILE_MODE)  # the umask may have narrowed it; O_TRUNC kept an old one
            f.write(FRAME.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)))
            f.write(header)
            for offset, tensor in zip(offsets, record.payloads):
                f.write(b"\0" * (offset - f.tell()))
                f.write(memoryview(as_bytes(tensor)))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    def _read(self, slot: Slot) -> PageRecord | None:
        try:
            with open(self._path(slot), "rb") as f:
                buf = np.empty(os.fstat(f.fileno()).st_size, dtype=np.uint8)
                n = f.readinto(memoryview(buf))
        except OSError:
            return None
        return _parse(buf[:n])

    def _delete(self, slot: Slot) -> None:
        try:
            self._path(slot).unlink(missing_ok=True)
        except OSError as e:
            log.warning("cannot delete %s: %s", self._path(slot), e)

    def _touched(self, slot: Slot) -> None:
        try:
            os.utime(self._path(slot))
        except OSError:
            pass

    # -- start-up -------------------------------------------------------------------------
    def _recover(self) -> None:
        found = []
        self._tightened += sum(_tighten(d, DIR_MODE) for d in self.root.iterdir() if d.is_dir())
        for path in self.root.glob("*/*"):
            if path.name.endswith(TMP):  # a write that never completed
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                found.extend(self._scan_one(path))
        if self._tightened:
            log.warning("made %d directories and files under %s private to this user "
                        "(0700 / 0600); they were open to others", self._tightened, self.path)
        for _, slot, header, size in sorted(found, key=lambda f: f[0]):
            self._index_add(slot, header, size)
        self._evict_until(self.capacity_bytes)
        self._make_room(0)   # the disk filled up while the store was down

    def _scan_one(self, path: Path) -> list[tuple[float, Slot, RecordHeader, int]]:
        slot = self._slot_of(path)
        try:
            st = path.stat()
            framed = _read_header(path) if slot else None
        except OSError:
            framed = None
        problem = "unparsable" if framed is None or slot is None else (
            header_problem(framed[0], self.layout, self.algo, slot[1], pool=slot[0]))
        if not problem and _offsets(*framed)[1] != st.st_size:
            problem = f"size {st.st_size} disagrees with its header (torn write?)"
        if problem:
            log.warning("dropping %s at start: %s", path, problem)
            path.unlink(missing_ok=True)
            self._stats.count(Event.VERIFICATION_FAILED)
            return []
        self._tightened += _tighten(path, FILE_MODE, st.st_mode)
        return [(st.st_mtime, slot, framed[0], st.st_size)]


def _make_private_dirs(path: Path) -> None:
    """``path`` and its missing parents, each one created 0700 whatever the umask."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another writer; tightened at its next start
        os.chmod(directory, DIR_MODE)  # NOTE: mkdir's mode is filtered by the umask


def _tighten(path: Path, mode: int, current: int | None = None) -> int:
    """Set ``path``'s permissions to ``mode`` if they differ; 1 if they did."""
    try:
        if current is None:
            current = path.stat().st_mode
        if stat.S_IMODE(current) == mode:
            return 0
        os.chmod(path, mode)
    except OSError as e:
        log.warning("cannot make %s private (mode %o): %s", path, mode, e)
        return 0
    return 1


def _rounded(nbytes: int, block: int) -> int:
    """What a file of ``nbytes`` takes on a filesystem of ``block``-byte blocks."""
    return -(-nbytes // block) * block


def _offsets(header: RecordHeader, header_len: int) -> tuple[list[int], int]:
    """Where each payload starts, and the file's total size."""
    offsets, end = [], FRAME.size + header_len
    for entry in header.pools:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        size = stored_nbytes(entry, header.seal is not None)
        if size < 0:
            raise ValueError(f"bad payload description {entry.dtype}{list(entry.shape)}")
        end = start + size
    return offsets, end


def _read_header(path: Path) -> tuple[RecordHeader, int] | None:
    """The header of a record file and its encoded length; ``None`` if it does not parse."""
    with open(path, "rb") as f:
        frame = f.read(FRAME.size)
        if len(frame) < FRAME.size:
            return None
        magic, length, digest = FRAME.unpack(frame)
        raw = f.read(length)
    header = _decode(magic, raw, length, digest)
    return None if header is None else (header, length)


def _decode(magic: bytes, raw: bytes, length: int, digest: int) -> RecordHeader | None:
    if magic != MAGIC or len(raw) != length or xxhash.xxh3_64_intdigest(raw) != digest:
        return None
    try:
        header = decode_header(raw)
        _offsets(header, length)
    except ValueError:
        return None
    return header


def _parse(buf: np.ndarray) -> PageRecord | None:
    """A record viewing ``buf``; ``None`` if the bytes are not a whole record."""
    if len(buf) < FRAME.size:
        return None
    magic, length, digest = FRAME.unpack_from(buf)
    header = _decode(magic, buf[FRAME.size:FRAME.size + length].tobytes(), length, digest)
    if header is None:
        return None
    offsets, end = _offsets(header, length)
    if end != len(buf):
        return None
    payloads = []
    sealed = header.seal is not None
    for offset, entry in zip(offsets, header.pools):
        raw = torch.from_numpy(buf[offset:offset + stored_nbytes(entry, sealed)])
        payloads.append(typed(raw, entry, sealed))
    return PageRecord(header, tuple(payloads))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
