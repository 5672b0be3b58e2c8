"""Replica sets (``storage.replicas`` > 1): which shards hold a segment, and the parts of a
batch a later replica is asked for or repaired with."""

from __future__ import annotations

from pd_cache.core.hashing import page_hashes
from pd_cache.storage.base import ExtraInfo, PoolHits, PoolTransfer
from pd_cache.storage.batch import check_batch
from pd_cache.storage.placement import chain_replicas, chain_shards, rendezvous, replica_set
from pd_cache.storage.rebuild import chains, copies
from pd_cache.storage.replica_parts import Part, joined_hits, part_call, parts, presence, runs
from pd_cache.storage.replicas import RankClient


def names(n: int, salt: int = 0) -> list[bytes]:
    return page_hashes([salt * 100_000 + i for i in range(4 * n)], 4)


def test_the_first_replica_is_the_single_copy_shard_and_the_set_has_distinct_shards() -> None:
    sets = [replica_set(k, 5, 3) for k in names(200)]
    assert [s[0] for s in sets] == [rendezvous(k, 5) for k in names(200)]
    assert all(len(set(s)) == 3 for s in sets)
    assert {s[1] for s in sets} == set(range(5))   # the second copies spread too
    chain = names(10)
    whole = chain_replicas(chain, [], 4, 4, 2)
    assert [s[0] for s in whole] == chain_shards(chain, [], 4, 4)
    for lo in range(10):   # any run of the chain finds the sets its writer chose
        assert chain_replicas(chain[lo:], chain[:lo], 4, 4, 2) == whole[lo:]


def test_replicas_go_to_distinct_nodes_before_a_second_shard_of_one_node() -> None:
    nodes = ["a", "a", "a", "b"]   # three shards on node a, one on b
    for k in names(100):
        s = replica_set(k, 4, 2, nodes)
        assert {nodes[s[0]], nodes[s[1]]} == {"a", "b"}
        assert s[0] == rendezvous(k, 4)
        assert len(set(replica_set(k, 4, 3, nodes))) == 3   # more copies than nodes: filled
    assert replica_set(names(1)[0], 4, 2, ["n"] * 4) == replica_set(names(1)[0], 4, 2)


def test_a_rank_client_places_each_page_on_its_rank_of_the_set() -> None:
    chain, nodes = names(9), ["a", "b", "a", "b"]
    ranks = [RankClient([None] * 4, rank=r, replicas=2, nodes=nodes, segment_pages=4)
             for r in range(2)]
    sets = chain_replicas(chain, [], 4, 4, 2, nodes)
    for r, client in enumerate(ranks):
        assert client.shards_of(chain, []) == [s[r] for s in sets]
        assert client.shard_of(chain[0]) == replica_set(chain[0], 4, 2, nodes)[r]


def test_parts_are_runs_placed_by_the_names_before_them() -> None:
    assert runs([1, 2, 3, 5, 7, 8]) == [[1, 2, 3], [5], [7, 8]]
    chain = names(6)
    got = [PoolTransfer("kv", chain), PoolTransfer("state", chain[4:])]
    want = [[False, False, True, True, False, True], [True, False]]
    asked = parts(got, want, chained=True)
    assert asked == [Part(0, "kv", [2, 3]), Part(0, "kv", [5]), Part(1, "state", [0])]
    info = ExtraInfo(prefix_keys=["ab" * 16], request_id="r")
    call, sub = part_call(got, asked[0], info)
    assert call == [PoolTransfer("kv", chain[2:4])]
    assert list(sub.prefix_keys) == ["ab" * 16, *chain[:2]] and sub.request_id == "r"
    call, sub = part_call(got, asked[2], info, pages=["p4", "p5"])
    assert call == [PoolTransfer("state", chain[4:5], ["p4"])]   # placed at position 4
    assert list(sub.prefix_keys) == ["ab" * 16, *chain[:4]]
    # without a chain every page is placed by its own name: one part per pool
    assert parts(got, want, chained=False) == [Part(0, "kv", [2, 3, 5]), Part(1, "state", [0])]
    assert part_call(got, Part(0, "kv", [2, 5]), None) == ([PoolTransfer("kv", [chain[2],
                                                                                chain[5]])], None)


def test_exists_answers_join_key_by_key_over_the_replicas() -> None:
    chain = names(6)
    ask = [PoolTransfer("kv", chain), PoolTransfer("state", chain[4:])]
    batches = check_batch(ask, ExtraInfo(prefix_keys=[]), "xxh3_128", with_pages=False)
    # replica 0: shard 0 has pages 0..3 of its 0..3, shard 1 none of its 4, 5 (restarted)
    plan = {0: [(0, [0, 1, 2, 3])], 1: [(0, [4, 5]), (1, [0, 1])]}
    first = presence(batches, plan, {0: PoolHits({"kv": 4}, 4),
                                     1: PoolHits({"kv": 0, "state": 0}, 0,
                                                 {"state": [False, False]})})
    assert first == [[True] * 4 + [False] * 2, [False, False]]
    # replica 1: page 0..3 on a shard that lost them, 4, 5 and their states held
    plan = {2: [(0, [0, 1, 2, 3])], 0: [(0, [4, 5]), (1, [0, 1])]}
    second = presence(batches, plan, {0: PoolHits({"kv": 2, "state": 2}, 2,
                                                  {"state": [True, True]})})
    assert second == [[False] * 4 + [True] * 2, [True, True]]
    assert joined_hits(batches, [first]).usable == 0   # neither alone holds a usable prefix
    assert joined_hits(batches, [second]).usable == 0
    assert joined_hits(batches, [first, second]) == PoolHits(
        {"kv": 6, "state": 2}, 6, {"state": [True, True]})


def test_the_shards_links_make_one_chain_per_branch_from_its_head() -> None:
    seed, (a, b, c, d, e) = b"s" * 16, names(5)
    links = [(c, b), (a, seed), (b, a), (d, b), (e, d)]
    assert sorted(chains(links)) == sorted([(seed, [a, b, c]), (seed, [a, b, d, e])])
    assert chains([(d, b), (e, d)]) == [(b, [d, e])]   # a lost head: placed from d
    assert chains([(a, b), (b, a)]) == []   # a cycle holds no head


def test_a_rank_gets_each_run_it_lacks_from_the_first_rank_that_holds_it() -> None:
    marks = [[False, False, True, True, False, False],    # rank 0: a restarted shard's run
             [True, True, True, False, False, True],
             [True, True, True, True, True, False]]
    assert copies(marks, 0) == [(1, [0, 1]), (2, [4]), (1, [5])]
    assert copies(marks, 1) == [(0, [3]), (2, [4])]
    assert copies(marks, 2) == [(1, [5])]
