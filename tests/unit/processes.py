"""Real processes standing for other workers or shards: a sleeping child is a live one, a
reaped one is gone (its pid free for the kernel to hand out again); and the kernel's nice
value of each thread of a process, read from ``/proc``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def live_child() -> Iterator[int]:
    """The pid of a child process that sleeps until the block ends."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


def dead_pid() -> int:
    """The pid of a child process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def thread_nices(pid: int | str = "self") -> dict[int, int]:
    """The nice value of each thread of process ``pid``, by thread id (``/proc``'s ``stat``
    field 19; the command name before it may hold spaces and parentheses)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):   # a thread that just ended
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
    return out
