"""Process identity (``core.procs``) on real processes: a pid names a running process only
together with its start time, since the kernel hands pids out again."""

from __future__ import annotations

import os

from pd_cache.core.procs import process_alive, process_start
from tests.unit.processes import dead_pid, live_child


def test_process_start_times() -> None:
    with live_child() as pid:
        # NOTE: an independent fact: the child was started after this process.
        assert process_start(pid) >= process_start(os.getpid()) > 0
    assert process_start(dead_pid()) == 0


def test_a_pid_is_alive_only_with_its_own_start_time() -> None:
    with live_child() as pid:
        start = process_start(pid)
        assert process_alive(pid) and process_alive(pid, start)
        # the same pid, as a process started earlier would have had it: a reused pid
        assert not process_alive(pid, start - 1)
    assert not process_alive(pid) and not process_alive(pid, start)
    assert not process_alive(dead_pid())
