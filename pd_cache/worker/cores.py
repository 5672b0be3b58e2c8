"""Idle cores lent to the worker that has work.

Every worker actor runs its forwards on ``ClusterConfig.threads`` torch threads (1 by
default), so that the prefill and decode workers of a node do not fight over its cores.
That leaves cores idle whenever fewer workers than cores have work: a prompt alone on an
idle node takes as long as on a busy one. With lending on, a prompt's forward (at least
``LEND_MIN_TOKENS`` new tokens) first looks at what the node's other workers hold now and
borrows the cores they leave idle, up to the node's count; before each layer it looks
again, so a worker that gets work meanwhile has its core back within one layer, and gives
them back when it ends. Decode steps never borrow, and a decode worker holds its core
from its batch's first step until the batch empties (no prompt borrows it between steps).

The node's ledger (``worker.ledger``) is a small file under the temp directory, one slot
per worker process: its pid, the threads it holds (0 while idle) and the process's start
time. Reads take no lock: a stale read costs a forward a core too many or too few for one
layer. A slot whose process is gone counts as idle, and is taken over by the next worker
that starts; so does one whose pid now names another process (pids are reused).

::

    free = node cores - sum(held of the other live slots);  a forward takes
    max(base, min(free, node cores))
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from pd_cache.core.stats import Stats
from pd_cache.worker.ledger import (
    HELD,
    SLOTS,
    default_root,
    file_name,
    live_holders,
    open_and_claim,
    own_folder,
    sweep,
)

log = logging.getLogger(__name__)

CORES = "cores"    # the stats event of a forward on borrowed cores (``cores/borrowed``)
# NOTE: below this many new tokens a prompt's forward on the `small` model was no faster on
# two threads than on one. Decode steps do not borrow: in a decode loop (a pause between
# steps) two threads were no faster for 15-22% more CPU, and in the cluster TPOT was
# 1.15-1.21x longer (docs/benchmarks.md).
LEND_MIN_TOKENS = 128


def node_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup's CPU quota
    (a container's limit) when one is set."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))


class CoreLedger:
    """This process's slot in its node's ledger (see the module docstring).

    ``base``: the threads a forward always runs on; ``cores``: the node's cores (the most a
    forward takes). ``None`` from ``open`` when the ledger cannot be used (every slot
    taken by a live process, no writable temp directory): forwards then keep ``base``.
    """

    def __init__(self, table: np.ndarray, slot: int, base: int, cores: int) -> None:
        if base < 1 or cores < 1:
            raise ValueError(f"CoreLedger: base {base} and cores {cores} must be >= 1")
        self.table, self.slot, self.base, self.cores = table, slot, base, cores
        self._lock = threading.Lock()
        self._running = self._forward = 0
        self._busy = False

    @classmethod
    def open(cls, node: str, *, base: int = 1, cores: int | None = None,
             pid: int | None = None, root: Path | None = None) -> CoreLedger | None:
        """Claim a slot in ``node``'s ledger (created if missing) for process ``pid``."""
        pid = os.getpid() if pid is None else pid
        path = (root or default_root()) / file_name(node)
        try:
            own_folder(path.parent)
            table, slot = open_and_claim(path, pid)
            sweep(path.parent, keep=path)
        except OSError as e:
            log.warning("core ledger %s: %s; forwards keep %d thread(s)", path, e, base)
            return None
        if slot is None:
            log.warning("core ledger %s: all %d slots are held; forwards keep %d thread(s)",
                        path, SLOTS, base)
            return None
        return cls(table, slot, base, node_cores() if cores is None else cores)

    def others(self) -> int:
        """Threads the node's other live workers hold now."""
        return sum(n for slot, _, n in live_holders(self.table) if slot != self.slot)

    def take(self, borrow: bool) -> int:
        """Threads for a forward starting now, held until ``give``: ``base``, or with
        ``borrow`` every core the node's other workers leave idle."""
        with self._lock:
            self._running += 1
            # NOTE: a second forward of this process at once keeps ``base``: torch's thread
            # count is the process's, and the first one set it.
            n = self.base
            if borrow and self._running == 1:
                n = max(self.base, self.cores - self.others())
            self._forward += n
            self._write()
            return n

    def retake(self, n: int) -> int:
        """The threads a borrowing forward holding ``n`` should hold now (before its next
        layer): what the node's other workers leave idle, at least ``base``."""
        with self._lock:
            if self._running != 1:
                return n
            now = max(self.base, self.cores - self.others())
            self._forward += now - n
            self._write()
            return now

    def give(self, n: int) -> None:
        with self._lock:
            self._running -= 1
            self._forward -= n
            self._write()

    def mark_busy(self, busy: bool) -> None:
        """Hold ``base`` between forwards too while ``busy`` (a decode batch in flight:
        its steps follow one another, and a core lent in a gap would be fought over)."""
        with self._lock:
            self._busy = busy
            self._write()

    def _write(self) -> None:
        self.table[self.slot, HELD] = max(self._forward, self.base if self._busy else 0)

    def close(self) -> None:
        """Leave the slot (a later worker may take it)."""
        self.table[self.slot] = 0


class Cores:
    """What a worker's forwards run under. Without a ledger every forward keeps the threads
    the process was given; with one, ``forward`` borrows idle cores for a prompt's forward
    of at least ``LEND_MIN_TOKENS`` tokens, and ``step`` (a decode step) never borrows.

    ``layers``: the model's layers; before each one a borrowing forward weighs the node
    again (a hook), so that a worker that gets work meanwhile has its core back within a
    layer, and cores freed meanwhile are taken. ``stats`` counts ``cores/borrowed``:
    forwards that ran on more threads than ``base`` at some layer."""

    def __init__(self, ledger: CoreLedger | None = None, stats: Stats | None = None,
                 layers: Iterable[torch.nn.Module] = ()) -> None:
        self.ledger, self.stats = ledger, stats
        self._lent: int | None = None     # threads of the borrowing forward under way
        self._counted = False
        if ledger is not None:
            for layer in layers:
                layer.register_forward_pre_hook(self._before_layer)

    def forward(self, tokens: int) -> contextlib.AbstractContextManager[int]:
        """A prompt's forward over ``tokens`` new tokens."""
        return self._held(tokens >= LEND_MIN_TOKENS)

    def step(self) -> contextlib.AbstractContextManager[int]:
        """A decode step: the worker is busy from now until ``idle`` (its batch empty)."""
        if self.ledger is not None:
            self.ledger.mark_busy(True)
        return self._held(False)

    def idle(self) -> None:
        """The worker's decode batch is empty."""
        if self.ledger is not None:
            self.ledger.mark_busy(False)

    @contextlib.contextmanager
    def _held(self, borrow: bool) -> Iterator[int]:
        ledger = self.ledger
        if ledger is None:
            yield torch.get_num_threads()
            return
        n = ledger.take(borrow)
        lends = borrow and self._lent is None
        if lends:
            self._lent, self._counted = n, False
        self._use(n)
        try:
            yield n
        finally:
            # NOTE: back to ``base`` before the cores are given back: the copies and the
            # sampling between forwards must not run on cores another worker now holds.
            if lends:
                n, self._lent = self._lent or n, None
            self._use(ledger.base)
            ledger.give(n)

    def _before_layer(self, *_: object) -> None:
        if self._lent is None or self.ledger is None:
            return
        self._lent = self.ledger.retake(self._lent)
        self._use(self._lent)

    def _use(self, n: int) -> None:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        if self.ledger is not None and n > self.ledger.base and not self._counted:
            self._counted = True
            if self.stats is not None:
                self.stats.count(CORES, "borrowed")

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
