"""Whether a process of this machine still runs, told apart from a later one with its pid.

Pids are reused (``/proc/sys/kernel/pid_max`` is often 32768), so a pid alone can name a
process started after the one that was meant. Where a process's identity matters (a core
ledger's slot, a shard's arena), its start time is kept beside its pid and checked too.
"""

from __future__ import annotations

import os


def process_start(pid: int) -> int:
    """When process ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat``'s
    22nd field); 0 where that cannot be read (no such process, no ``/proc``)."""
    # NOTE: os.open and os.read (9 us here) rather than Path.read_bytes (27 us): a
    # borrowing forward reads every live slot's before each layer.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            raw = os.read(fd, 1024)
        finally:
            os.close(fd)
        # NOTE: the command name (field 2) may hold spaces and parentheses: count the
        # fields after its closing one (field 3 first).
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def process_alive(pid: int, start: int = 0) -> bool:
    """Whether the process that was ``pid`` at ``start`` (``process_start``; 0: unknown,
    the pid alone decides) still runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # someone else's process: it exists
    return not start or process_start(pid) in (0, start)
