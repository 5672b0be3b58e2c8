"""A memory shard's arena: record slots in shared memory that a worker on the shard's node
seals straight into, so a set costs one pass over the bytes (the cipher's) and no copy.

::

    shard   memfd of fixed-size slots; each slot free, granted to a writer (a lease), or live
    writer  arena_grant(sizes) -> (slot, generation) per record; maps the memfd once through
            /proc/<shard pid>/fd/<n>; seals each record into its slot, then writes the
            slot's commit word = generation; batch_set_v2 carries ArenaRecords, which
            travel as header + slot + generation (no payload crosses Ray)
    shard   adopts a granted slot whose commit word is its generation (the record is
            whole); a slot freed (eviction, discard) gets word 0 and goes to the back of
            the free queue, so it is reused as late as possible
    reader  a lent ArenaRecord is a view of its slot in the reader's own mapping, used only
            while the word still holds its generation (the AEAD tag covers the bytes)

The memfd (nothing on any filesystem; it dies with the shard and the last mapping)::

    0       8      24                 64                    data_at (4 KiB aligned)
    | magic | id   | (unused)         | word[0] ... word[n-1] | slot 0 | slot 1 | ...

A shard killed and restarted makes a new arena with a new id: a worker never maps an old
arena again (the shard names only its current one), and drops mappings of dead shards
when it maps a new one. The arena's slots must live on the writer's machine and Ray node
(``node``: the kernel's boot id and the Ray node's id), and a mapping whose magic and id are
not the arena's is refused.
"""

from __future__ import annotations

import mmap
import os
import select
import sys
import threading
from collections import deque
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from pd_cache.core.fields import check_int_at_least
from pd_cache.core.procs import process_alive, process_start

MAGIC = b"pdarena1"
WORDS_AT = 64
ALIGN = 64            # slot size granularity (a cache line)
MADV_POPULATE_WRITE = 23   # Linux 5.14+; not in Python 3.11's mmap module
LEASE_S = 60.0        # a granted slot never adopted (its writer died) is free again after this
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def this_node() -> str:
    """This machine's boot id, and in a Ray process its Ray node's id (``""`` if the boot
    id is unknown: then no arena is shared). Two Ray nodes on one machine share none: each
    keeps to its own, as on two machines."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        return ""
    ray = sys.modules.get("ray")
    if boot and ray is not None and ray.is_initialized():
        return f"{boot}/{ray.get_runtime_context().get_node_id()}"
    return boot


class ArenaInfo(msgspec.Struct, frozen=True, gc=False):
    """What a process needs to map a shard's arena."""

    id: bytes
    pid: int
    fd: int
    node: str
    slots: int
    slot_bytes: int
    start: int = 0   # the shard process's start (``process_start``): its pid may be reused

    @property
    def data_at(self) -> int:
        return -(-(WORDS_AT + 8 * self.slots) // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def size(self) -> int:
        return self.data_at + self.slots * self.slot_bytes


class Arena:
    """One mapping of an arena: slot views and commit words."""

    def __init__(self, info: ArenaInfo, mm: mmap.mmap, fd: int | None = None) -> None:
        self.info, self._mm, self._fd = info, mm, fd
        self._pidfd = _pidfd(info) if fd is None else None
        self._words = np.frombuffer(mm, np.uint64, count=info.slots, offset=WORDS_AT)
        self._ready = np.zeros(info.slots, dtype=bool)   # slots faulted in here for writing
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=info.data_at,
                                      count=info.slots * info.slot_bytes) if info.slots \
            else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, slot_bytes: int, slots: int) -> Arena:
        """A new arena of ``slots`` slots of ``slot_bytes`` (rounded up), owned here."""
        check_int_at_least("slot_bytes", slot_bytes, 1)
        check_int_at_least("slots", slots, 1)
        info = ArenaInfo(os.urandom(16), os.getpid(), -1, this_node(), slots,
                         -(-slot_bytes // ALIGN) * ALIGN, process_start(os.getpid()))
        fd = os.memfd_create("pd-cache-arena", os.MFD_CLOEXEC)
        os.ftruncate(fd, info.size)
        mm = mmap.mmap(fd, info.size)
        mm[:8], mm[8:24] = MAGIC, info.id
        return _remember(cls(msgspec.structs.replace(info, fd=fd), mm, fd))

    @classmethod
    def attach(cls, info: ArenaInfo) -> Arena:
        """Map another process's arena (``OSError`` if it cannot be, or is not ``info``'s)."""
        if not info.node or info.node != this_node():
            raise OSError(f"arena {info.id.hex()} is on another machine or Ray node")
        fd = os.open(f"/proc/{info.pid}/fd/{info.fd}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, info.size)
        finally:
            os.close(fd)
        if mm[:8] != MAGIC or mm[8:24] != info.id:
            mm.close()
            raise OSError(f"/proc/{info.pid}/fd/{info.fd} is not arena {info.id.hex()}")
        return cls(info, mm)

    def view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """Slot ``slot``'s bytes (its first ``nbytes``), a writable view."""
        at = slot * self.info.slot_bytes
        return self._data[at:at + (self.info.slot_bytes if nbytes is None else nbytes)]

    def prefault(self) -> bool:
        """Fault every slot's memory in now (one ``MADV_POPULATE_WRITE`` over them): the
        shard allocates its pool when it starts, as a serving engine allocates its KV memory
        up front, and no write pays for a fresh page later (on a VM about 130 us a 32 KiB
        slot, measured in the writer; a slot already in memory costs its mapping alone).
        ``False`` where the kernel cannot: the first writes then fault the pages in."""
        if not self.info.slots:
            return True
        try:
            self._mm.madvise(MADV_POPULATE_WRITE, self.info.data_at,
                             self.info.slots * self.info.slot_bytes)
        except (OSError, ValueError):
            return False
        self._ready[:] = True
        return True

    def prepare(self, slot: int) -> None:
        """Fault ``slot`` in for writing, the first time only (a slot written through
        fresh page tables costs a fault per 4 KiB page, several times the cipher's time;
        one ``MADV_POPULATE_WRITE`` call is a fraction of it). Best effort."""
        if self._ready[slot]:
            return
        self._ready[slot] = True
        lo = self.info.data_at + slot * self.info.slot_bytes
        start = lo - lo % mmap.PAGESIZE
        try:
            self._mm.madvise(MADV_POPULATE_WRITE, start, lo + self.info.slot_bytes - start)
        except (OSError, ValueError):
            pass   # an older kernel: the writes fault the pages in

    @property
    def alive(self) -> bool:
        """Whether its shard still runs: this process (it owns the memfd), or the process
        that made it, not a later one that got its pid. A reader asks once per record it
        is lent: through a pidfd that is a 1-2 us poll (a pidfd names one process, never a
        later one with its pid) against about 20 us to read ``/proc`` (no pidfd here)."""
        if self._fd is not None:
            return True
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]   # readable: it exited
        return process_alive(self.info.pid, self.info.start)

    def word(self, slot: int) -> int:
        return int(self._words[slot])

    def set_word(self, slot: int, value: int) -> None:
        # NOTE: an aligned 8-byte store: a reader sees the old or the new word, never half.
        self._words[slot] = value

    def close(self) -> None:
        _OPEN.pop(self.info.id, None)
        del self._words, self._data
        try:
            self._mm.close()
        except BufferError:
            pass   # views still held somewhere: unmapped when they go
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class SlotTable:
    """Which slots are free, granted (until a lease runs out) or live; pure bookkeeping.

    Slots used before are handed out first, oldest-freed first (their memory is faulted
    in, and a reader still holding a reference to one has the longest time to finish),
    then slots never used (memory the arena commits only then). Generations only grow: a
    slot's word names one grant, never an earlier one of the same slot.
    """

    def __init__(self, slots: int, lease_s: float = LEASE_S) -> None:
        self.freed: deque[int] = deque()
        self.fresh: deque[int] = deque(range(slots))
        self.granted: dict[int, tuple[int, float]] = {}   # slot -> (generation, deadline)
        self.live: dict[int, int] = {}                     # slot -> generation
        self.lease_s, self._gen = lease_s, 0

    @property
    def free(self) -> int:
        return len(self.freed) + len(self.fresh)

    def grant(self, n: int, now: float) -> list[tuple[int, int]]:
        """Up to ``n`` free slots, each with a new generation."""
        out = []
        while self.free and len(out) < n:
            slot = (self.freed or self.fresh).popleft()
            self._gen += 1
            self.granted[slot] = (self._gen, now + self.lease_s)
            out.append((slot, self._gen))
        return out

    def adopt(self, slot: int, gen: int) -> bool:
        """Make a slot granted under ``gen`` live; ``False`` if it is not that grant."""
        if self.granted.get(slot, (None,))[0] != gen:
            return False
        del self.granted[slot]
        self.live[slot] = gen
        return True

    def release(self, slot: int) -> None:
        """A granted or live slot is free again (no-op if it is neither)."""
        if self.granted.pop(slot, None) is not None or self.live.pop(slot, None) is not None:
            self.freed.append(slot)

    def expired(self, now: float) -> list[int]:
        """Granted slots whose lease ran out (not yet released)."""
        return [slot for slot, (_, deadline) in self.granted.items() if deadline <= now]


class Grant(msgspec.Struct, frozen=True, gc=False):
    """A shard's answer to ``arena_grant``: its arena (``None``: none to share with this
    caller) and per size asked, a ``(slot, generation)`` or ``None`` (no room, too big);
    ``spare``: slots granted ahead of need (a lease the writer uses for its next sets)."""

    arena: ArenaInfo | None
    slots: list[tuple[int, int] | None]
    spare: list[tuple[int, int]] = []


# -- this process's mappings, by arena id ---------------------------------------------------
_OPEN: dict[bytes, Arena] = {}
_LOCK = threading.Lock()


def _pidfd(info: ArenaInfo) -> int | None:
    """A pidfd of the process that made the arena, if it still runs and this kernel has
    them; ``None`` otherwise (``Arena.alive`` then reads ``/proc``)."""
    try:
        fd = os.pidfd_open(info.pid)
    except (OSError, AttributeError):
        return None
    if info.start and process_start(info.pid) != info.start:   # NOTE: after the open: it
        os.close(fd)                                            # names that process
        return None
    return fd


def _remember(arena: Arena) -> Arena:
    with _LOCK:
        _OPEN[arena.info.id] = arena
    return arena


def attached(info: ArenaInfo) -> Arena | None:
    """This process's mapping of ``info``'s arena, made now if need be (and mappings of
    arenas whose shard died dropped); ``None`` if it cannot be mapped from here, or its
    shard is dead (its records are no longer the store's: never served)."""
    with _LOCK:
        arena = _OPEN.get(info.id)
    if arena is not None and arena.alive:
        return arena
    for stale in [a for a in list(_OPEN.values()) if not a.alive]:
        stale.close()
    try:
        return _remember(Arena.attach(info))
    except (OSError, ValueError):
        return None


def mapped() -> list[ArenaInfo]:
    """The arenas this process maps (its own and other processes')."""
    with _LOCK:
        return [a.info for a in _OPEN.values()]


def forget(ids: Sequence[bytes]) -> None:
    """Unmap the arenas ``ids`` (a shard answered with a new one: it restarted)."""
    for arena in [a for a in list(_OPEN.values()) if a.info.id in ids and a._fd is None]:
        arena.close()
