"""The arena a memory shard shares with the writers on its machine: a real memfd mapped by
another process through /proc, slots granted, sealed into, committed, adopted (no copy),
lent back as references and opened bit for bit; uncommitted or stale slots refused; freed
slots reused; slot bookkeeping."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from pd_cache.core.sealing import Keyring
from pd_cache.storage.arena import Arena, SlotTable, this_node
from pd_cache.storage.arena_backend import ArenaBackend, slot_bytes
from pd_cache.storage.arena_record import ArenaRecord, Lost
from pd_cache.storage.arena_writer import Slotted, committed
from pd_cache.storage.base import PoolTransfer
from pd_cache.storage.seal import Sealer, sealed_nbytes
from tests.unit.storage.records import Chain, bits, layout_for

TENANT = "acme"


def test_slot_table_reuses_freed_slots_oldest_first_and_expires_leases() -> None:
    table = SlotTable(4, lease_s=10)
    first = table.grant(2, now=0)
    assert [s for s, _ in first] == [0, 1] and first[0][1] < first[1][1]
    assert table.grant(5, now=0) == [(2, 3), (3, 4)]      # only what is free
    assert table.adopt(0, first[0][1]) and not table.adopt(1, 99)
    assert table.expired(now=9) == [] and table.expired(now=10) == [1, 2, 3]
    table.release(2)
    table.release(0)
    table.release(0)                                       # twice: no double free
    assert list(table.freed) == [2, 0] and table.free == 2
    assert table.grant(1, now=11) == [(2, 5)]              # oldest freed, a new generation
    assert table.grant(2, now=11) == [(0, 6)]              # expired is not free till released


def test_another_process_maps_the_arena_and_writes_a_slot() -> None:
    arena = Arena.create(100, 4)
    assert arena.info.slot_bytes == 128 and arena.info.node == this_node()
    code = ("import sys, pickle\nfrom pd_cache.storage.arena import Arena\n"
            "info = pickle.loads(sys.stdin.buffer.read())\n"
            "a = Arena.attach(info)\na.view(2)[:5].copy_(__import__('torch').tensor("
            "list(b'hello'), dtype=__import__('torch').uint8))\na.set_word(2, 7)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # NOTE: the child is no Ray process, so it names this machine by its boot id alone; this
    # process is one when the suite's Ray cluster is up (its node then carries Ray's id too)
    info = msgspec.structs.replace(arena.info, node=this_node().split("/")[0])
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(info), check=True,
                   env=env, timeout=60)
    assert bytes(arena.view(2)[:5].numpy()) == b"hello" and arena.word(2) == 7
    with pytest.raises(OSError):   # a descriptor that is not this arena's
        Arena.attach(arena.info.__class__(os.urandom(16), os.getpid(), arena.info.fd,
                                          arena.info.node, 4, 128))
    arena.close()


def sealed_into(backend: ArenaBackend, sealer: Sealer, chain: Chain) -> list[ArenaRecord]:
    """What a writer does: slots granted, each record sealed into its slot, committed,
    and sent (a pickle round trip, as Ray's)."""
    grant = backend.arena_grant([sealed_nbytes(r) for r in chain.records], this_node())
    assert grant.arena is not None and all(grant.slots)
    arena = backend.arena
    out = []
    for record, (slot, gen) in zip(chain.records, grant.slots):
        where = Slotted(arena, slot, gen)
        out.append(committed(sealer.seal(record, TENANT, where.view(sealed_nbytes(record))),
                             where))
    return [pickle.loads(pickle.dumps(r)) for r in out]


def test_a_shard_adopts_sealed_slots_and_lends_them_back_by_reference() -> None:
    layout = layout_for()
    chain = Chain(layout, 4)
    backend = ArenaBackend(layout, 6 * slot_bytes(layout))
    sealer = Sealer(Keyring.random())
    sent = sealed_into(backend, sealer, chain)
    assert len(pickle.dumps(sent[0])) < 1024                   # no payload on the wire
    assert all(isinstance(r, ArenaRecord) for r in sent)
    assert backend.batch_set_v2([PoolTransfer("kv", chain.names, sent)]) == [[True] * 4]
    assert backend.arena_usage()["live"] == 4 and backend.usage().records == 4
    # a reader on this machine gets references; elsewhere, the bytes
    near = backend.batch_lend_v2([PoolTransfer("kv", chain.names)], node=this_node())[0]
    far = backend.batch_lend_v2([PoolTransfer("kv", chain.names)], node="elsewhere")[0]
    assert all(isinstance(p, ArenaRecord) for p in near.pages)
    assert all(not isinstance(p, ArenaRecord) for p in far.pages)
    for got, lent, want in zip(pickle.loads(pickle.dumps(far.pages)),
                               pickle.loads(pickle.dumps(near.pages)), chain.records):
        for page in (got, lent):
            opened = sealer.open(page, TENANT)
            assert opened.record is not None
            assert bits(opened.record.payload()) == bits(want.payload())
    # a slot freed (discarded) is no longer served to a reference lent before
    backend.discard_v2("kv", chain.names[3:])
    assert isinstance(pickle.loads(pickle.dumps(near.pages[3])), Lost)
    assert backend.arena_usage() == {"id": backend.arena.info.id, "free": 3, "granted": 0,
                                     "live": 3, "grant_calls": 1}


def test_uncommitted_and_stale_slots_are_refused_and_freed_slots_reused() -> None:
    layout = layout_for()
    backend = ArenaBackend(layout, 2 * slot_bytes(layout))
    sealer = Sealer(Keyring.random())
    first = Chain(layout, 2, seed=1)
    backend.table.lease_s = 0   # a grant not used by the next one is given back then
    grant = backend.arena_grant([sealed_nbytes(r) for r in first.records], this_node())
    arena, (slot, gen) = backend.arena, grant.slots[0]
    record = sealer.seal(first.records[0], TENANT, arena.view(slot, sealed_nbytes(
        first.records[0])))
    half = ArenaRecord(record.header, record.payloads, committed(record, Slotted(
        arena, slot, gen)).where)
    arena.set_word(slot, 0)   # as if the writer had not finished: not whole
    assert backend.batch_set_v2([PoolTransfer("kv", first.names[:1], [half])]) == [[False]]
    assert backend.stats()["refused/storage_error"] == 1
    assert backend.arena_usage()["free"] == 1                   # the slot given back
    backend.table.lease_s = 60
    # the table is full twice over: later chains evict earlier ones and reuse their slots
    for seed in (2, 3):
        chain = Chain(layout, 2, seed=seed)
        sent = sealed_into(backend, sealer, chain)
        assert backend.batch_set_v2([PoolTransfer("kv", chain.names, sent)]) == [[True] * 2]
    assert backend.arena_usage()["live"] == 2 and backend.usage().records == 2
    got = backend.batch_get_v2([PoolTransfer("kv", chain.names)])[0].pages
    for page, want in zip(got, chain.records):
        opened = sealer.open(page, TENANT)
        assert opened.record is not None and torch.equal(
            opened.record.payload().view(torch.uint8), want.payload().view(torch.uint8))


def _shmem_kib() -> int:
    """This process's resident shared memory (``RssShmem``), as the kernel counts it."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("RssShmem:"))
    return int(line.split()[1])


@pytest.mark.parametrize("prefault", [True, False])
def test_a_prefaulted_arena_holds_its_memory_from_the_start(prefault: bool) -> None:
    """``arena_prefault``: the shard's memory is in before any write (the kernel's count of
    this process's shared pages grows by the arena's slots), and a writer's first use of a
    slot has nothing left to fault in; without it nothing is in until a slot is written."""
    before = _shmem_kib()
    backend = ArenaBackend(layout_for(), 8 << 20, prefault=prefault)
    arena = backend.arena
    assert arena is not None
    grown = _shmem_kib() - before
    data_kib = arena.info.slots * arena.info.slot_bytes // 1024
    if prefault:
        assert grown >= data_kib * 0.95 and bool(arena._ready.all())
    else:
        assert grown < data_kib * 0.05 and not arena._ready.any()
    arena.close()
