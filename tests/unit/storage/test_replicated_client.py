"""``ReplicatedClient``'s logic over in-process shards: each rank's placement (the real
``RankClient.plan``) run against one ``MemoryBackend`` per shard instead of actors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pd_cache.storage.base import ExtraInfo, PoolTransfer, Ready, usable_prefix
from pd_cache.storage.batch import check_batch
from pd_cache.storage.client import _merger, _share
from pd_cache.storage.memory import MemoryBackend
from pd_cache.storage.placement import chain_replicas
from pd_cache.storage.rebuild import rebuild
from pd_cache.storage.replicas import RankClient, ReplicatedClient
from tests.unit.storage.records import Chain, assert_same, layout_for

LAYOUT = layout_for()
NODES = ["a", "b", "a"]   # shards 0 and 2 on one node: a segment's copies are on both


class LocalRank:
    """``rank``'s calls, planned as the rank plans them, answered by ``shards`` (a dead
    shard, in ``dead``, answers nothing: misses and refusals)."""

    def __init__(self, rank: RankClient, shards: list[MemoryBackend], dead: set[int]) -> None:
        self.rank, self.shards, self.dead = rank, shards, dead

    def _run(self, transfers: Sequence[PoolTransfer], info: ExtraInfo | None, op: str,
             pages: bool) -> tuple[Any, Any, dict[int, Any]]:
        batches = check_batch(transfers, info, "xxh3_128", with_pages=pages)
        plan = self.rank.plan(batches, info)
        return batches, plan, {s: getattr(self.shards[s], op)(_share(batches, parts), info)
                               for s, parts in plan.items() if s not in self.dead}

    def submit_get_v2(self, transfers: Any, info: Any = None) -> Ready[Any]:
        batches, plan, answers = self._run(transfers, info, "batch_get_v2", False)
        return Ready(_merger(batches, plan, None, lambda b, p: PoolTransfer(b.pool, b.keys, p))(
            answers))

    def submit_set_v2(self, transfers: Any, info: Any = None) -> Ready[Any]:
        batches, plan, answers = self._run(transfers, info, "batch_set_v2", True)
        return Ready(_merger(batches, plan, False, lambda b, acks: acks)(answers))

    def exists(self, transfers: Any, info: Any, merge: Any) -> Ready[Any]:
        batches, plan, answers = self._run(transfers, info, "batch_exists_v2", False)
        return Ready(merge(batches, plan, answers))


def replicated(dead: set[int]) -> tuple[ReplicatedClient, list[MemoryBackend]]:
    shards = [MemoryBackend(LAYOUT, 1 << 24) for _ in NODES]
    client = ReplicatedClient([None] * 3, replicas=2, nodes=NODES, segment_pages=4)
    for rank in client.ranks:
        local = LocalRank(rank, shards, dead)
        rank.submit_get_v2 = local.submit_get_v2   # type: ignore[method-assign]
        rank.submit_set_v2 = local.submit_set_v2   # type: ignore[method-assign]
        rank._exists = local.exists                # type: ignore[method-assign]
    return client, shards


def test_a_shard_restarted_empty_loses_no_hit_and_the_reads_repair_it() -> None:
    dead: set[int] = set()
    client, shards = replicated(dead)
    chain = Chain(LAYOUT, 12, seed=3, state_shape=(2, 4))
    info = ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)
    ops = [PoolTransfer("kv", chain.names, chain.records),
           PoolTransfer("state", chain.names[9:], chain.states[9:])]
    assert client.batch_set_v2(ops, info) == [[True] * 12, [True] * 3]
    client.settle(wait=True)
    sets = chain_replicas(chain.names, [], 3, 4, 2, NODES)
    assert all({NODES[a], NODES[b]} == {"a", "b"} for a, b in sets)
    assert sum(s.usage().records for s in shards) == 2 * 15   # two copies of each record
    victim = sets[0][0]   # the first segment's first copy
    shards[victim].clear()   # a memory shard restarted empty
    ask = [PoolTransfer("kv", chain.names), PoolTransfer("state", chain.names[9:])]
    assert client.batch_exists_v2(ask, info).usable == 12
    got = client.batch_get_v2(ask, info)
    assert usable_prefix(got) == 12
    for g, want in zip(got[0].pages, chain.records):
        assert_same(g, want)
    for g, want in zip(got[1].pages, chain.states[9:]):
        assert_same(g, want)
    client.settle(wait=True)
    # the pages whose first copy is the victim were written back there; the others (the
    # victim their second copy, read from the first) were not
    first = [i for i, s in enumerate(sets) if s[0] == victim]
    second = [i for i, s in enumerate(sets) if s[1] == victim]
    held = set(shards[victim].held()["storage"])
    assert held == {chain.names[i] for i in first} and first and second
    counts = client.counts()
    states_back = sum(1 for i in range(9, 12) if i in first)
    assert counts["repaired"] == len(first) + states_back and counts["under_replicated"] == 0


def test_a_dead_first_copy_still_acknowledges_and_serves_and_counts_what_it_lacks() -> None:
    dead: set[int] = set()
    client, shards = replicated(dead)
    chain = Chain(LAYOUT, 8, seed=4)
    info = ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)
    sets = chain_replicas(chain.names, [], 3, 4, 2, NODES)
    victim = sets[0][0]
    dead.add(victim)
    assert client.batch_set(chain.names, chain.records, info) == [True] * 8   # a copy landed
    short = {chain.names[i] for i, s in enumerate(sets) if victim in s}
    first = {chain.names[i] for i, s in enumerate(sets) if s[0] == victim}
    counts = client.counts()
    assert counts["under_replicated"] == len(short) and counts["copies_refused"] == len(short)
    assert counts["copies_stored"] == 2 * 8 - len(short)
    got = client.batch_get(chain.names, info)
    assert all(g is not None for g in got)   # what the dead shard held first, from the 2nd
    client.settle(wait=True)
    counts = client.counts()   # the repairs to the dead shard failed: still a copy short
    assert counts["repaired"] == 0 and counts["under_replicated"] == len(short)
    dead.clear()
    client.batch_get(chain.names, info)   # it is back (empty): the next read repairs it
    client.settle(wait=True)
    assert set(shards[victim].held()["storage"]) == first
    assert client.counts()["under_replicated"] == len(short - first)
    # rebuild_storage copies the rest: the pages the victim holds second, from their first
    client.primary._gather = lambda method: [getattr(s, method)() for s in shards]
    done = rebuild(client, bytes_per_s=1e12)
    assert done.pages == len(short - first) and done.bytes > 0
    assert set(shards[victim].held()["storage"]) == short
    assert client.counts()["under_replicated"] == 0
    assert rebuild(client, bytes_per_s=1e12).pages == 0


def test_a_read_the_first_copy_serves_asks_no_other_copy() -> None:
    client, _ = replicated(set())
    chain = Chain(LAYOUT, 6, seed=5)
    info = ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)
    asked: list[Any] = []
    later, held = client.ranks[1].submit_get_v2, client.ranks[1]._exists
    client.ranks[1].submit_get_v2 = lambda *a: asked.append(a) or later(*a)  # type: ignore
    client.ranks[1]._exists = lambda *a: asked.append(a) or held(*a)        # type: ignore
    assert client.batch_set(chain.names, chain.records, info) == [True] * 6
    client.settle(wait=True)
    assert [g is not None for g in client.batch_get(chain.names, info)] == [True] * 6
    assert asked == []   # one call, as with one copy
    new = Chain(LAYOUT, 6, seed=6)   # a new prompt's pages: no copy holds them
    assert client.batch_get(new.names, ExtraInfo(prefix_keys=[], namespace_seed=new.seed)) \
        == [None] * 6
    assert len(asked) == 1   # the second copy asked once, for what the first missed
    assert client.counts().get("repairs_sent", 0) == 0
