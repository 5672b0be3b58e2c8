"""Each role's CPU over a run, sampled, and the cores it left idle by phase.

A thread reads every process's ``/proc/PID/stat`` (utime + stime) every ``interval_s``
while the run goes; afterwards ``phases`` splits the run at two moments of its requests::

    0 ...... first prefill's end ...... last prefill's end ...... end
      start                 steady                        tail
      (prefill only)        (prefill and decode)            (decode only: no prompt left)

and says, per phase, how busy the run kept the machine's cores (its processes' CPU over
the phase's wall time x cores) and each role's share of a core. The cores' idle share of
the run is ``1 - use``: where ``tail`` is long and its use near one core of two, the last
decode batches stepped on one core while the other waited.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from thread_cpu import stat_cpu  # this folder


def process_cpu(pid: int) -> float:
    """utime + stime of a process of this machine (Linux ``/proc``), in seconds; 0 if gone."""
    try:
        return stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0


def role_cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds each role's processes have used so far."""
    return {role: sum(process_cpu(p) for p in ids) for role, ids in pids.items()}


class Timeline(threading.Thread):
    """Samples ``(seconds since start, {role: CPU s so far})`` until ``stop``."""

    def __init__(self, pids: dict[str, list[int]], interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop_event = threading.Event()
        self.start_s = time.perf_counter()

    def read(self) -> dict[str, float]:
        return role_cpu(self.pids)

    def run(self) -> None:
        while True:
            self.samples.append((time.perf_counter() - self.start_s, self.read()))
            if self._stop_event.wait(self.interval_s):
                break
        self.samples.append((time.perf_counter() - self.start_s, self.read()))

    def stop(self) -> list[tuple[float, dict[str, float]]]:
        self._stop_event.set()
        self.join()
        return self.samples


def by_worker(pids: dict[str, list[int]], role: str) -> dict[str, list[int]]:
    """``pids`` with ``role``'s processes one by one (``decode0``, ``decode1``, ...)."""
    rest = {r: ids for r, ids in pids.items() if r != role}
    return {**rest, **{f"{role}{i}": [pid] for i, pid in enumerate(pids[role])}}


def _at(samples: Sequence[tuple[float, dict[str, float]]], t: float) -> dict[str, float]:
    """Each role's CPU at ``t``, linear between the two samples around it."""
    before = max((s for s in samples if s[0] <= t), key=lambda s: s[0], default=samples[0])
    after = min((s for s in samples if s[0] >= t), key=lambda s: s[0], default=samples[-1])
    if after[0] <= before[0]:
        return dict(before[1])
    w = (t - before[0]) / (after[0] - before[0])
    return {r: before[1][r] + w * (after[1][r] - before[1][r]) for r in before[1]}


def phases(samples: Sequence[tuple[float, dict[str, float]]], bounds: Sequence[float],
           lanes: int) -> dict[str, dict[str, float]]:
    """Per phase (``start``, ``steady``, ``tail``, and the whole ``run``) between the times
    ``bounds`` = (0, first answer, last prefill's end, end): its seconds, ``use`` (CPU of
    every role / (seconds x ``lanes``)) and each role's CPU share of one core."""
    names = ("start", "steady", "tail")
    spans = [*zip(names, bounds, bounds[1:], strict=False), ("run", bounds[0], bounds[-1])]
    out = {}
    for name, a, b in spans:
        lo, hi = _at(samples, a), _at(samples, b)
        seconds = max(b - a, 1e-9)
        cpu = {r: hi[r] - lo[r] for r in lo}
        out[name] = {"seconds": b - a, "use": sum(cpu.values()) / (seconds * lanes),
                     **{f"{r}_cores": c / seconds for r, c in cpu.items()}}
    return out


def run_bounds(prefilled: Sequence[float], seconds: float) -> list[float]:
    """(0, first prefill's end, last prefill's end, ``seconds``): ``prefilled`` holds each
    request's prefill end (its first token) in seconds since the run's start."""
    return [0.0, min(prefilled, default=0.0), max(prefilled, default=seconds), seconds]


def describe(name: str, table: dict[str, dict[str, float]],
             say: Callable[[str], None] = print) -> None:
    for phase, row in table.items():
        roles = ", ".join(f"{k[:-6]} {v:.2f}" for k, v in row.items() if k.endswith("_cores"))
        say(f"  {name} {phase:>6}: {row['seconds']:.2f} s, cores {row['use']:.0%} busy "
            f"(cores by role: {roles})")
