"""Placement on L3 shards per chain segment, found from the chain's names alone."""

from __future__ import annotations

from pd_cache.core.hashing import page_hashes
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.batch import check_batch
from pd_cache.storage.client import StorageClient
from pd_cache.storage.placement import chain_shards, rendezvous


def names(n: int, salt: int = 0) -> list[bytes]:
    return page_hashes([salt * 100_000 + i for i in range(4 * n)], 4)


def test_any_run_of_a_chain_finds_the_shards_its_writer_chose() -> None:
    chain = names(10)
    whole = chain_shards(chain, [], 3, 4)
    # the segments 0..3, 4..7, 8..9, each on its anchor's shard
    assert whole == [rendezvous(chain[i - i % 4], 3) for i in range(10)]
    for lo in range(10):
        for hi in range(lo + 1, 11):   # a reader past a local hit of lo pages, any length
            assert chain_shards(chain[lo:hi], chain[:lo], 3, 4) == whole[lo:hi]


def test_segments_spread_chains_over_the_shards_and_no_chain_goes_page_by_page() -> None:
    firsts = [chain_shards(names(8, salt), [], 4, 8) for salt in range(1, 41)]
    assert all(len(set(s)) == 1 for s in firsts)   # one segment: one shard
    assert {s[0] for s in firsts} == {0, 1, 2, 3}
    chain = names(8)
    assert chain_shards(chain, None, 4, 8) == [rendezvous(k, 4) for k in chain]
    assert chain_shards(chain, [], 1, 8) == [0] * 8


def test_a_batch_in_one_segment_reaches_one_shard_with_its_sidecar() -> None:
    chain = names(12)
    client = StorageClient([None] * 4, segment_pages=8)
    ask = [PoolTransfer("kv", chain[2:8]), PoolTransfer("state", chain[7:8])]
    info = ExtraInfo(prefix_keys=chain[:2])
    plan = client.plan(check_batch(ask, info, "xxh3_128", with_pages=False), info)
    assert list(plan) == [rendezvous(chain[0], 4)]
    assert plan[rendezvous(chain[0], 4)] == [(0, list(range(6))), (1, [0])]
    # across a segment's end: two shards at most, each with its own run
    info = ExtraInfo(prefix_keys=chain[:6])
    plan = client.plan(check_batch([PoolTransfer("kv", chain[6:12])], info, "xxh3_128",
                                    with_pages=False), info)
    owners = {s: pos for s, [(_, pos)] in plan.items()}
    assert sorted(owners.values()) == sorted([[0, 1], [2, 3, 4, 5]])
