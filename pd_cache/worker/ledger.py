"""The node's core ledger on disk (``worker.cores``): one file per Ray node, a table of
slots, one per worker process.

::

    slot:  [ pid | threads held | start ]   x SLOTS, int64, in <tmp>/pd-cache-cores/<node>.ledger

The folder is this user's alone and no symlink is followed (it lies in a temp directory
others can write). A slot is claimed under the file's ``flock``; reads take no lock. A
slot counts as held only while its process runs: the pid names a running process that
started at ``start`` (pids are reused). Each cluster started makes a node id, and a file,
of its own; a worker that opens its node's removes the files in which no live process
holds a slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pd_cache.core.procs import process_alive, process_start

log = logging.getLogger(__name__)

SLOTS = 256
PID, HELD, START = 0, 1, 2    # START: the process's start time, clock ticks after boot
COLUMNS = 3


def held(root: Path | None = None) -> dict[str, dict[int, int]]:
    """What the live workers hold now, by node ledger under ``root`` (default: the temp
    directory's): ``{node: {pid: threads}}``, idle workers left out."""
    out: dict[str, dict[int, int]] = {}
    for path in sorted((root or default_root()).glob("*.ledger")):
        try:
            raw = np.fromfile(path, dtype=np.int64)
        except FileNotFoundError:   # NOTE: a starting worker's sweep removed it just now
            continue
        if raw.size < SLOTS * COLUMNS:   # NOTE: an older layout's file (no start times)
            continue
        table = raw[:SLOTS * COLUMNS].reshape(SLOTS, COLUMNS)
        out[path.stem] = {pid: n for _, pid, n in live_holders(table)}
    return out


def live_holders(table: np.ndarray) -> list[tuple[int, int, int]]:
    """``(slot, pid, threads)`` of each slot holding threads whose process is running."""
    out = []
    for i in np.nonzero(table[:, HELD] > 0)[0]:
        pid, n = int(table[i, PID]), int(table[i, HELD])
        if process_alive(pid, int(table[i, START])):
            out.append((int(i), pid, n))
    return out


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "pd-cache-cores"


def own_folder(folder: Path) -> None:
    """``folder`` made if missing (this user's alone), and refused (``OSError``) if it is
    a symlink or another user's."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{folder} is not a folder of this user's")


def file_name(node: str) -> str:
    if not node or not all(c.isalnum() or c in "-_." for c in node):
        raise ValueError(f"node: {node!r} is not a plain name (letters, digits, - _ .)")
    return f"{node}.ledger"


@contextlib.contextmanager
def _locked(path: Path, create: bool, wait: bool = True) -> Iterator[Any]:
    """``path`` opened and locked (``flock``) for this process alone, while it is still the
    file the folder names (a sweep may have removed it meanwhile: then opened again);
    ``None`` instead if it is gone (``create=False``) or, without ``wait``, locked by
    another process."""
    # NOTE: no symlink followed: the folder is in a temp directory others can write.
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    while True:
        try:
            f = open(os.open(path, flags, 0o600), "r+b")
        except FileNotFoundError:
            if create:
                raise
            yield None
            return
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield None
                return
            try:
                if _same_file(f, path):
                    yield f
                    return
            finally:
                # NOTE: explicitly: a map of the file holds a copy of the descriptor, and
                # with it the lock, for as long as it lives.
                fcntl.flock(f, fcntl.LOCK_UN)
        if not create:
            yield None
            return


def _same_file(f: Any, path: Path) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


def open_and_claim(path: Path, pid: int) -> tuple[np.ndarray, int | None]:
    """``path``'s table, mapped, and the slot claimed in it for ``pid``."""
    with _locked(path, create=True) as f:
        if os.fstat(f.fileno()).st_size < SLOTS * COLUMNS * 8:
            f.truncate(SLOTS * COLUMNS * 8)
        table = np.memmap(f, dtype=np.int64, mode="r+", shape=(SLOTS, COLUMNS))
        slot = _claim(table, pid)
        table.flush()
    return table, slot


def sweep(folder: Path, keep: Path) -> int:
    """Remove the ledgers in ``folder`` (but ``keep``) whose slots hold no live process:
    those of Ray nodes that are gone (each cluster started makes a node id, and a ledger,
    of its own). One that another process has locked, or of another layout (another
    version's), is left alone. How many were removed."""
    removed = 0
    for path in folder.glob("*.ledger"):
        if path == keep:
            continue
        try:
            removed += _remove_if_unheld(path)
        except OSError as e:   # NOTE: not ours to judge (a symlink, say): left alone
            log.debug("core ledger %s: left alone: %s", path, e)
    return removed


def _remove_if_unheld(path: Path) -> bool:
    with _locked(path, create=False, wait=False) as f:
        if f is None:
            return False
        raw = np.fromfile(f, dtype=np.int64)
        if raw.size != SLOTS * COLUMNS:   # NOTE: another layout: another version's
            return False
        table = raw.reshape(SLOTS, COLUMNS)
        if any(process_alive(int(row[PID]), int(row[START]))
               for row in table[table[:, PID] != 0]):
            return False
        path.unlink()
        return True


def _claim(table: np.ndarray, pid: int) -> int | None:
    """The first slot that is ``pid``'s already, empty, or of a process that is gone."""
    for i in range(SLOTS):
        owner = int(table[i, PID])
        if owner in (0, pid) or not process_alive(owner, int(table[i, START])):
            table[i] = (pid, 0, process_start(pid))
            return i
    return None
