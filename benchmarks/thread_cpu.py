"""CPU seconds by thread of a set of processes (Linux ``/proc``), grouped by thread name.

A benchmark reads the clocks of a role's processes before and after a run; the difference
says where each process's CPU went: the actor's main thread (``ray::PrefillAct main``), its
other Python threads (the L3 writer's among them: Python does not name them to the kernel,
so they keep the process's name, ``ray::PrefillAct``), Ray's core-worker and gRPC threads
(``worker.io``, ...). Thread names are the kernel's (15 characters at most), trailing digits
and dashes dropped so that a pool's threads add up under one name::

    before = thread_cpu(pids)
    ...
    spent = thread_cpu_delta(before, thread_cpu(pids))   # {"pd-cache-backu": 0.12, ...}
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

_TAIL = re.compile(r"[-_.\d]+$")


TICK = os.sysconf("SC_CLK_TCK")


def stat_fields(stat: str) -> list[str]:
    """A ``/proc/.../stat`` line's fields after the command name (which may hold spaces and
    parentheses): the state (field 3) first."""
    return stat.rsplit(")", 1)[1].split()


def stat_cpu(stat: str) -> float:
    """utime + stime, in seconds, of a process's or thread's ``/proc/.../stat`` line."""
    fields = stat_fields(stat)
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu(pids: Iterable[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """Per thread (pid, tid) of ``pids``: its name group and user + system CPU seconds."""
    out = {}
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            group = thread_group(name) + (" main" if int(task.name) == pid else "")
            out[(pid, int(task.name))] = (group, stat_cpu(stat))
    return out


def kernel_side(pids: Iterable[int]) -> tuple[int, float]:
    """Minor page faults and system CPU seconds ``pids`` have taken so far (a process gone
    counts nothing): what the kernel did for them, such as mapping in fresh memory."""
    faults, system = 0, 0.0
    for pid in pids:
        try:
            fields = stat_fields(Path(f"/proc/{pid}/stat").read_text())
        except OSError:
            continue
        faults += int(fields[7])
        system += int(fields[12]) / TICK
    return faults, system


def thread_group(name: str) -> str:
    """A thread's name less its trailing counter (``grpc_global_tim`` stays itself)."""
    return _TAIL.sub("", name) or name


def thread_cpu_delta(before: Mapping[tuple[int, int], tuple[str, float]],
                     after: Mapping[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each thread group used between two readings (threads born in between
    count from zero; a thread gone by ``after`` is not counted), largest first."""
    spent: dict[str, float] = {}
    for key, (name, t) in after.items():
        used = t - before.get(key, (name, 0.0))[1]
        spent[name] = spent.get(name, 0.0) + used
    return dict(sorted(((k, round(v, 3)) for k, v in spent.items() if v > 0),
                       key=lambda kv: -kv[1]))
