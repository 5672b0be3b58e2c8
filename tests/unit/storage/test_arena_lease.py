"""Arena slots leased ahead of need: a grant call gives spare slots from the free ones only;
a writer takes a set's slots from its lease when it holds one for every page (no call),
all or none, never past half the shard's lease, and never from a shard that died (its
pid gone, or taken by a later process; a mapping sees it die at once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from pd_cache.core.procs import process_alive, process_start
from pd_cache.storage.arena import LEASE_S, Arena, this_node
from pd_cache.storage.arena_backend import ArenaBackend, slot_bytes
from pd_cache.storage.arena_writer import ArenaWriter, Leases, Slotted
from tests.unit.processes import dead_pid, live_child
from tests.unit.storage.records import layout_for


def test_a_lease_hands_out_all_or_none_and_drops_what_ran_out() -> None:
    leases = Leases()
    leases.add([(1, 11), (2, 12), (3, 13)], asked_at=100.0)
    assert leases.take(4, now=101.0) is None and len(leases) == 3   # too few: none taken
    assert leases.take(2, now=101.0) == [(1, 11), (2, 12)]            # first granted first
    assert leases.take(0, now=101.0) == []
    assert leases.take(1, now=100.0 + LEASE_S / 2) is None           # half the lease: gone
    assert len(leases) == 0


def test_a_grant_leases_spare_slots_from_the_free_ones_only() -> None:
    layout = layout_for()
    backend = ArenaBackend(layout, 4 * slot_bytes(layout))
    size = slot_bytes(layout)
    grant = backend.arena_grant([size, size], this_node(), spare=5)
    assert all(grant.slots) and len(grant.spare) == 2                 # the 2 free ones
    assert not {s for s, _ in grant.spare} & {s for s, _ in grant.slots}
    usage = backend.arena_usage()
    assert (usage["granted"], usage["free"], usage["grant_calls"]) == (4, 0, 1)
    again = backend.arena_grant([size], this_node(), spare=3)
    assert again.slots == [None] and again.spare == []                 # leases are not taken
    assert backend.arena_usage()["grant_calls"] == 2


def test_a_writer_sets_from_its_lease_and_forgets_a_dead_shards() -> None:
    arena = Arena.create(100, 8)
    writer = ArenaWriter(client=None, lease_ahead=4)   # only the lease bookkeeping is used
    writer._arenas[0], writer._leases[0] = arena, Leases()
    writer._leases[0].add([(1, 11), (2, 12), (3, 13)], asked_at=0.0)
    out: list[Slotted | None] = [None] * 3
    # two pages that fit a slot take two leased slots; a record too big for one needs none
    assert writer._leased(0, [0, 1, 2], [100, 120, 200], out, now=1.0) == []
    assert out == [Slotted(arena, 1, 11), Slotted(arena, 2, 12), None]
    assert writer._spare(0) == 3                                        # topped up to 4
    out = [None] * 2
    assert writer._leased(0, [0, 1], [100, 100], out, now=1.0) == [0, 1]   # 1 left: ask
    assert out == [None, None] and len(writer._leases[0]) == 1
    assert writer._leased(1, [5], [100], out, now=1.0) == [5]          # no lease there
    with live_child() as pid:
        # another process's arena (a mapping with no memfd of its own), its shard running
        shard = Arena(msgspec.structs.replace(arena.info, pid=pid, start=process_start(pid)),
                      arena._mm)
        writer._arenas[0] = shard
        assert shard.alive and writer._leased(0, [0], [100], [None], now=1.0) == []
        # the shard died and a later process got its pid: its slots are nobody's
        writer._leases[0].add([(4, 14)], asked_at=0.0)
        writer._arenas[0] = Arena(msgspec.structs.replace(shard.info, start=shard.info.start - 1),
                                  arena._mm)
        assert writer._leased(0, [0], [100], [None], now=1.0) == [0]
        assert len(writer._leases[0]) == 0
    # the shard's process is gone and its pid free: the same
    writer._leases[0].add([(5, 15)], asked_at=0.0)
    writer._arenas[0] = Arena(msgspec.structs.replace(shard.info, pid=dead_pid(), start=0),
                              arena._mm)
    assert writer._leased(0, [0], [100], [None], now=1.0) == [0]
    assert len(writer._leases[0]) == 0
    assert arena.alive and arena.info.start == process_start(os.getpid()) > 0   # its own
    arena.close()


@pytest.mark.parametrize("pidfds", [True, False])
def test_a_mapping_sees_its_shard_die_at_once(monkeypatch, pidfds: bool) -> None:
    # A reader's mapping made while the shard ran; then the shard is killed (-9). With a
    # pidfd the exit shows before the process is even reaped; without (an older kernel)
    # /proc says so once it is gone.
    if not pidfds:
        monkeypatch.delattr(os, "pidfd_open")
    arena = Arena.create(100, 2)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        shard = Arena(msgspec.structs.replace(arena.info, pid=child.pid,
                                              start=process_start(child.pid)), arena._mm)
        assert (shard._pidfd is not None) == pidfds
        assert shard.alive
        child.send_signal(signal.SIGKILL)
        if pidfds:
            deadline = time.monotonic() + 10
            while shard.alive and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not shard.alive
            # not reaped yet: /proc still shows the process (a zombie) as it was
            assert process_alive(child.pid, shard.info.start)
        child.wait()
        assert not shard.alive
        shard.close()
        assert shard._pidfd is None
    finally:
        child.kill()
        child.wait()
    arena.close()
