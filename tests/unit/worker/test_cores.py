"""The node's core ledger (``worker.cores``, ``worker.ledger``): real files, real processes
as the other workers (a sleeping child is a live worker; a reaped one is gone)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pd_cache.core.procs import process_start
from pd_cache.core.stats import Stats
from pd_cache.worker.cores import LEND_MIN_TOKENS, CoreLedger, Cores, node_cores
from pd_cache.worker.ledger import COLUMNS, HELD, PID, SLOTS, START, held
from tests.unit.processes import dead_pid, live_child


@pytest.fixture
def other() -> Iterator[int]:
    """The pid of a live process standing for another worker of the node."""
    with live_child() as pid:
        yield pid


def ledger(tmp_path: Path, pid: int, cores: int = 2) -> CoreLedger:
    out = CoreLedger.open("node-a", base=1, cores=cores, pid=pid, root=tmp_path)
    assert out is not None
    return out


def test_a_forward_borrows_only_the_cores_others_leave_idle(tmp_path: Path, other: int) -> None:
    mine, theirs = ledger(tmp_path, os.getpid(), cores=3), ledger(tmp_path, other, cores=3)
    assert mine.slot != theirs.slot
    assert mine.take(borrow=True) == 3        # the node is idle: every core
    assert theirs.take(borrow=True) == 1      # none left: its own core only
    assert theirs.table[theirs.slot, HELD] == 1
    mine.give(3)
    assert mine.table[mine.slot, HELD] == 0
    assert theirs.others() == 0
    n = mine.take(borrow=True)                # the other holds 1 of 3
    assert n == 2
    assert mine.take(borrow=True) == 1        # a second forward of one process keeps base
    mine.give(1)
    mine.give(n)
    theirs.give(1)
    assert mine.take(borrow=False) == 1       # a decode step never borrows
    mine.give(1)


def test_a_busy_decode_worker_holds_its_core_between_steps(tmp_path: Path, other: int) -> None:
    prefill, decode = ledger(tmp_path, os.getpid()), ledger(tmp_path, other)
    decode.mark_busy(True)
    assert prefill.take(borrow=True) == 1
    prefill.give(1)
    decode.mark_busy(False)
    assert prefill.take(borrow=True) == 2
    prefill.give(2)


def test_a_dead_workers_slot_is_idle_and_taken_over(tmp_path: Path) -> None:
    gone = dead_pid()
    stale = ledger(tmp_path, gone)
    stale.take(borrow=True)                   # killed inside a forward: its count stays
    assert stale.table[stale.slot, HELD] == 2
    mine = ledger(tmp_path, os.getpid())
    assert mine.slot == 0 and stale.slot == 0  # the dead process's slot, claimed again
    assert mine.table[0, PID] == os.getpid() and mine.table[0, HELD] == 0
    assert mine.take(borrow=True) == 2


def test_a_full_ledger_lends_nothing(tmp_path: Path, other: int) -> None:
    first = ledger(tmp_path, other)
    first.table[:, PID] = other               # every slot held by a live process
    first.table[:, START] = process_start(other)
    assert CoreLedger.open("node-a", pid=os.getpid(), root=tmp_path) is None
    assert first.table.shape == (SLOTS, COLUMNS)


def test_a_slot_whose_pid_names_another_process_now_is_idle(tmp_path: Path,
                                                             other: int) -> None:
    """Pids are reused: a slot left holding cores by a killed worker whose pid a new
    process now has must not count, nor keep its slot."""
    mine, theirs = ledger(tmp_path, os.getpid()), ledger(tmp_path, other)
    assert theirs.table[theirs.slot, START] == process_start(other) > 0
    theirs.take(borrow=False)
    assert mine.others() == 1 and held(tmp_path) == {"node-a": {other: 1}}
    theirs.table[theirs.slot, START] -= 1     # as if ``other`` were an older process's pid
    assert mine.others() == 0 and held(tmp_path) == {"node-a": {}}
    assert mine.take(borrow=True) == 2
    mine.give(2)
    newcomer = ledger(tmp_path, dead_pid())
    assert newcomer.slot == theirs.slot       # taken over like a dead worker's


def test_an_older_layouts_ledger_is_left_out(tmp_path: Path, other: int) -> None:
    (tmp_path / "node-old.ledger").write_bytes(
        bytes(SLOTS * 16))                    # [pid, held] slots: no start times
    theirs = ledger(tmp_path, other)
    theirs.take(borrow=False)
    assert held(tmp_path) == {"node-a": {other: 1}}


def test_ledgers_of_gone_nodes_are_removed_when_a_worker_starts(tmp_path: Path,
                                                               other: int) -> None:
    """Each cluster makes a ledger of its own; a worker that opens its node's removes the
    ones nobody alive holds a slot in, and no other."""
    gone = ledger(tmp_path, dead_pid())
    gone.close()   # a worker that left cleanly: its slot is empty
    for node in ("node-dead", "node-live", "node-locked"):
        CoreLedger.open(node, pid=dead_pid() if node != "node-live" else other, root=tmp_path)
    (tmp_path / "node-old.ledger").write_bytes(bytes(SLOTS * 16))   # another layout
    (tmp_path / "elsewhere").write_bytes(bytes(SLOTS * COLUMNS * 8))
    (tmp_path / "node-link.ledger").symlink_to(tmp_path / "elsewhere")   # never followed
    with open(tmp_path / "node-locked.ledger", "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # another process is opening it now
        mine = CoreLedger.open("node-new", pid=os.getpid(), root=tmp_path)
    assert mine is not None
    assert sorted(p.stem for p in tmp_path.glob("*.ledger")) == [
        "node-link", "node-live", "node-locked", "node-new", "node-old"]
    # the locked one goes the next time, once nobody holds it
    CoreLedger.open("node-other", pid=other, root=tmp_path)
    assert sorted(p.stem for p in tmp_path.glob("*.ledger")) == [
        "node-link", "node-live", "node-new", "node-old", "node-other"]
    assert held(tmp_path)["node-live"] == {}   # a live worker's, idle


def test_a_ledger_removed_while_a_worker_opened_it_is_made_again(tmp_path: Path) -> None:
    """A sweep and a starting worker race for a file: the worker waits for the lock the
    sweep holds, the sweep removes the file, and the worker claims its slot in the file the
    folder names afterwards, never in the removed one (its node's other workers would not
    see it)."""
    path = tmp_path / "node-a.ledger"
    path.write_bytes(bytes(SLOTS * COLUMNS * 8))
    opened: list[CoreLedger | None] = []
    with open(path, "rb") as sweeping:
        fcntl.flock(sweeping, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: opened.append(
            CoreLedger.open("node-a", pid=os.getpid(), root=tmp_path)))
        worker.start()
        time.sleep(0.3)   # the worker has opened the file and waits for its lock
        path.unlink()
    worker.join(timeout=10)
    assert opened and opened[0] is not None
    table = np.fromfile(path, dtype=np.int64).reshape(SLOTS, COLUMNS)
    assert table[opened[0].slot, PID] == os.getpid()


def test_a_ledger_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "node-a.ledger").symlink_to(victim)
    assert CoreLedger.open("node-a", root=tmp_path / "links") is None
    (tmp_path / "folder").symlink_to(tmp_path / "links", target_is_directory=True)
    assert CoreLedger.open("node-b", root=tmp_path / "folder") is None
    assert victim.read_bytes() == b"keep"                # nothing written through a link
    assert not (tmp_path / "links" / "node-b.ledger").exists()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="node"):
        CoreLedger.open("../etc", root=tmp_path)
    with pytest.raises(ValueError, match="base 0"):
        CoreLedger.open("node-a", base=0, root=tmp_path)
    assert node_cores() >= 1


def test_cores_set_torch_threads_for_one_forward(tmp_path: Path, other: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stats = Stats()
        cores = Cores(ledger(tmp_path, os.getpid()), stats)
        with cores.forward(LEND_MIN_TOKENS) as n:
            assert n == 2 and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1 and stats.get("cores", "borrowed") == 1
        with cores.forward(LEND_MIN_TOKENS - 1) as n:     # too small to gain from it
            assert n == 1 and torch.get_num_threads() == 1
        with cores.step() as n:
            assert n == 1
        theirs = ledger(tmp_path, other)
        assert theirs.take(borrow=True) == 1              # decode is busy until idle()
        theirs.give(1)
        cores.idle()
        assert theirs.take(borrow=True) == 2
        theirs.give(2)
        assert stats.get("cores", "borrowed") == 1
        cores.close()
        assert theirs.others() == 0
        with Cores().forward(10_000) as n:                # no ledger: threads unchanged
            assert n == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_a_borrowing_forward_weighs_the_node_before_each_layer(tmp_path: Path,
                                                               other: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    layers = [torch.nn.Identity() for _ in range(3)]
    x = torch.zeros(2)
    try:
        stats = Stats()
        cores, theirs = Cores(ledger(tmp_path, os.getpid()), stats, layers), \
            ledger(tmp_path, other)
        with cores.forward(LEND_MIN_TOKENS):
            layers[0](x)
            assert torch.get_num_threads() == 2
            theirs.take(borrow=False)          # another worker starts: its core back
            layers[1](x)
            assert torch.get_num_threads() == 1 and cores.ledger is not None
            assert cores.ledger.table[cores.ledger.slot, HELD] == 1
            theirs.give(1)
            layers[2](x)                       # and taken again once it is idle
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1 and theirs.others() == 0
        assert stats.get("cores", "borrowed") == 1
        with cores.step():                     # a decode step's layers are not weighed
            layers[0](x)
            assert torch.get_num_threads() == 1
        cores.idle()
        assert theirs.others() == 0
    finally:
        torch.set_num_threads(before)
