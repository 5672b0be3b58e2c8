"""L3 replicas (``storage_replicas: 2``) on a real cluster: a memory shard killed with
SIGKILL comes back empty, and the next turn of every conversation still finds in L3 what L3
held before; reads repair the shard they fell back from, ``rebuild_storage`` the rest.

Central checks: every answer is the no-cache model's, the cached tokens by tier say L3
served what it held, and no slot or lock is left behind.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pd_cache import ClusterConfig, Completion, PDCluster, Req
from pd_cache.app.bench.workloads import Workload, multi_turn_workload
from pd_cache.core.sealing import Keyring
from pd_cache.model.digest import with_weights_digest
from pd_cache.model.model import Model
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.placement import rendezvous
from pd_cache.storage.rebuild import pools_of, rebuild
from pd_cache.storage.record import PageRecord
from pd_cache.storage.replicas import ReplicatedClient
from pd_cache.storage.seal import SealedStorage, Sealer
from pd_cache.storage.tier import storage_actors
from tests.integration.clusters import assert_idle, expected, l3_records, started, until
from tests.unit.storage.records import Chain, bits, random_bits

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(num_prefill=2, num_decode=1, num_storage=2, storage_replicas=2,
                       model="tiny", page_size=PS, device_pages=64, host_pages=128,
                       storage_timeout_s=5.0)
VOCAB = CONFIG.pd_config.model.vocab_size


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Iterator[PDCluster]:
    yield from started(CONFIG)


def turn_of(wl: Workload, answers: dict[int, list[int]], t: int) -> list[tuple[int, Req]]:
    return [(s.index, Req(rid=f"{s.session}/{t}", input_ids=s.prompt_ids(answers),
                          extra_key=s.extra_key, cache_salt=s.cache_salt,
                          max_new_tokens=s.max_tokens)) for s in wl.requests if s.turn == t]


def run_turn(cluster: PDCluster, model: Model, reqs: list[tuple[int, Req]],
             answers: dict[int, list[int]]) -> list[Completion]:
    outs = cluster.generate_many([r for _, r in reqs])
    for (index, r), out in zip(reqs, outs):
        assert out.output_ids == expected(model, r), r.rid
        answers[index] = out.output_ids
    return outs


def shard_holds(cluster: PDCluster, shard: int, names: list[bytes]) -> int:
    """How many of a chain's ``names``, from the first, ``shard`` itself holds."""
    ask = cluster.storage[shard].batch_exists_v2.remote([PoolTransfer("kv", names)],
                                                        ExtraInfo(prefix_keys=[]))
    return ray.get(ask).per_pool["kv"]


def kill_shard(cluster: PDCluster, shard: int) -> None:
    """kill -9 of a storage shard's process; back once a new process answers (empty)."""
    pid = ray.get(cluster.storage[shard].ping.remote())
    os.kill(pid, signal.SIGKILL)

    def back() -> bool:
        try:
            return ray.get(cluster.storage[shard].ping.remote(), timeout=30) != pid
        except ray.exceptions.RayActorError:
            return False
    until(back, f"shard {shard} never came back")


def whole_on(cluster: PDCluster, shard: int, chains: list[tuple[list[bytes], int]]
             ) -> list[bool]:
    """For each ``(names, held)``: does ``shard`` itself hold those ``held`` pages?"""
    return [shard_holds(cluster, shard, n[:h]) == h for n, h in chains]


def turn_after_kill(cluster: PDCluster, model: Model, wl: Workload,
                    answers: dict[int, list[int]], t: int, victim: int
                    ) -> list[tuple[list[bytes], int]]:
    """Turn ``t`` with L1 and L2 emptied and shard ``victim`` killed just before: L3 serves
    every page it held (its other copy). Returns each prompt's names and the pages of it
    L3 held that prefill reads (all but a last page ending at the last token)."""
    reqs = turn_of(wl, answers, t)
    names = [cluster.router_names(r) for _, r in reqs]
    held = [min(cluster.l3_holds(n), (len(r.input_ids) - 1) // PS)
            for n, (_, r) in zip(names, reqs)]
    assert min(held) > 0
    ray.get([a.drop_cache.remote() for a in cluster.prefill + cluster.decode])
    cluster.prefill_router.forget()
    cluster.decode_router.forget()
    kill_shard(cluster, victim)
    assert l3_records(cluster)[victim] == 0   # a memory shard comes back empty
    outs = run_turn(cluster, model, reqs, answers)
    for (_, r), h, out in zip(reqs, held, outs):
        assert out.cached_tokens.get("storage", 0) == h * PS, (r.rid, out.cached_tokens)
    cluster.flush()
    return list(zip(names, held))


def test_a_killed_memory_shard_loses_no_l3_hit(cluster: PDCluster) -> None:
    model = Model(CONFIG.pd_config.model)
    wl = multi_turn_workload(6, 1, 3, system_tokens=10, user_tokens=7, output_tokens=6,
                             vocab_size=VOCAB, seed=29)
    answers: dict[int, list[int]] = {}
    run_turn(cluster, model, turn_of(wl, answers, 0), answers)
    cluster.flush()
    until(lambda: len(set(l3_records(cluster))) == 1, "two shards, two copies: both hold all")
    chains = turn_after_kill(cluster, model, wl, answers, 1, victim=0)
    # a read that fell back repaired the shard it missed on (its chain's first copy); the
    # chains whose first copy is the other shard wait for rebuild_storage
    first = [rendezvous(n[0], 2) == 0 for n, _ in chains]
    assert 0 < sum(first) < len(first)
    until(lambda: whole_on(cluster, 0, chains) == first, "repair on read")
    rebuilt = cluster.rebuild_storage()
    assert rebuilt["pages"] > 0 and rebuilt["bytes"] > 0
    until(lambda: len(set(l3_records(cluster))) == 1, "rebuilt: both shards hold all")
    assert all(whole_on(cluster, 0, chains))
    turn_after_kill(cluster, model, wl, answers, 2, victim=1)   # the other one now
    assert cluster.rebuild_storage()["pages"] > 0
    until(lambda: len(set(l3_records(cluster))) == 1, "rebuilt again: both hold all")
    assert cluster.rebuild_storage()["pages"] == 0   # nothing left to copy
    assert_idle(cluster)


def test_a_copy_that_does_not_open_is_read_from_the_next_and_repaired(
        cluster: PDCluster) -> None:
    client = ReplicatedClient(cluster.storage, replicas=2,
                              segment_pages=CONFIG.pd_config.storage.segment_pages)
    store = SealedStorage(client, Sealer(Keyring.random()))
    chain = Chain(with_weights_digest(CONFIG.pd_config).layout, 6, seed=291)   # the shards'
    info = ExtraInfo(prefix_keys=[], namespace_seed=chain.seed, tenant="t")
    assert store.batch_set_v2([PoolTransfer("kv", chain.names, chain.records)], info) \
        == [[True] * 6]
    client.settle(wait=True)
    # the first copy of pages 1-3 loses a byte of its ciphertext (the shard cannot tell: it
    # holds no key); it is stored in place of the good one
    bare = ExtraInfo(prefix_keys=chain.names[:1], namespace_seed=chain.seed)
    first = client.ranks[0]
    sealed = first.batch_get_v2([PoolTransfer("kv", chain.names[1:4])], bare)[0].pages or []
    flipped = [PageRecord(r.header, (bit_flipped(r.payloads[0]),)) for r in sealed]
    at = first.shards_of(chain.names, [])
    ray.get([cluster.storage[at[i]].discard_v2.remote("kv", [chain.names[i]]) for i in (1, 2, 3)])
    assert first.batch_set_v2([PoolTransfer("kv", chain.names[1:4], flipped)], bare) \
        == [[True] * 3]
    got = store.batch_get_v2([PoolTransfer("kv", chain.names)], info)[0].pages or []
    for g, want in zip(got, chain.records):   # every page, from the copy that opens
        assert g is not None and bits(g.payload()) == bits(want.payload())
    assert store.stats()["miss/verification_failed"] == 3   # the bad copies, counted
    client.settle(wait=True)
    assert client.counts()["copies_rejected"] == 3 and client.counts()["repaired"] == 3
    # the first copy was repaired: read alone, every page opens
    alone = SealedStorage(first, store.sealer).batch_get_v2([PoolTransfer("kv", chain.names)],
                                                            info)[0].pages or []
    assert all(g is not None for g in alone)
    client.discard_v2("kv", chain.names)
    until(lambda: len(set(l3_records(cluster))) == 1, "the chain is gone from both shards")


def bit_flipped(payload: torch.Tensor) -> torch.Tensor:
    out = payload.clone().view(torch.uint8).view(-1)
    out[len(out) // 2] ^= 0x10
    return out.view(payload.dtype).view(payload.shape)


def test_rebuild_copies_a_hybrid_models_states(ray_cluster: Any) -> None:
    pd = ClusterConfig(model="tiny-hybrid", page_size=PS, num_storage=2,
                       storage_replicas=2).pd_config
    layout, handles = pd.layout, storage_actors(pd)
    try:
        client = ReplicatedClient(handles, replicas=2, segment_pages=pd.storage.segment_pages)
        chain = Chain(layout, 8, seed=292)
        states = {i: chain.record(i, {"state": random_bits(layout.state_shape, torch.float32, i)})
                  for i in (3, 7)}   # a state after every 4th page (checkpoints)
        for lo in (0, 4):   # two writes, each ending at a checkpoint, as a worker's
            info = ExtraInfo(prefix_keys=chain.names[:lo], namespace_seed=chain.seed)
            ops = [PoolTransfer("kv", chain.names[lo:lo + 4], chain.records[lo:lo + 4]),
                   PoolTransfer("state", [chain.names[lo + 3]], [states[lo + 3]])]
            assert client.batch_set_v2(ops, info) == [[True] * 4, [True]]
        client.settle(wait=True)
        ray.get(handles[0].drop_all.remote())   # a memory shard restarted empty
        done = rebuild(client, 1e12, pools_of(layout))
        assert done.pages == 8 + 2 and done.chains == 1   # every kv page and both states
        ask = [PoolTransfer("kv", chain.names), PoolTransfer("state", chain.names)]
        held = ray.get(handles[0].batch_exists_v2.remote(
            ask, ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)))
        assert held.per_pool["kv"] == 8
        assert (held.checkpoints or {})["state"] == [i in states for i in range(8)]
        assert rebuild(client, 1e12, pools_of(layout)).pages == 0
    finally:
        for h in handles:
            ray.kill(h)
