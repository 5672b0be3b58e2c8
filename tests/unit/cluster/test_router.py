"""The router's pure logic: prefix-aware prefill routing, decode packing and spreading."""

from __future__ import annotations

import pytest

from pd_cache.cluster.decode_route import spread
from pd_cache.cluster.router import NoLiveWorker, PrefixRouter
from pd_cache.core.cluster_config import ClusterConfig

PS = 4


def test_router_prefers_longest_match_until_overloaded() -> None:
    r = PrefixRouter(3, capacity_pages=4, balance_threshold=1)
    names = [bytes([i]) * 16 for i in range(4)]
    r.record(1, names[:3])
    r.record(2, names[:1])
    assert r.pick(names) == (1, 3)
    r.begin(1)
    assert r.pick(names).worker == 1  # one more in flight is within the threshold
    r.begin(1)
    # 2 - 0 > 1: an idle worker wins, the one with the longer match among the idle ones
    assert r.pick(names) == (2, 1)
    r.end(1), r.end(1)
    r.record(1, [bytes([9]) * 16, bytes([8]) * 16])  # capacity 4: the oldest names go
    assert r.matched(1, names) == 0
    with pytest.raises(ValueError, match="num_workers"):
        PrefixRouter(0, 4)


def test_decode_router_packs_until_the_batch_is_full() -> None:
    router = PrefixRouter(2, 0)
    picks = []
    for _ in range(5):
        w = router.pack(limit=2)
        router.begin(w)
        picks.append(w)
    assert picks == [0, 0, 1, 1, 0]   # fill worker 0, then 1; both full: least loaded
    router.end(1), router.end(1)
    assert router.loads == [3, 0] and router.pack(limit=2) == 1


def test_down_workers_are_routed_around_until_they_are_up_again() -> None:
    r = PrefixRouter(3, capacity_pages=8)
    names = [bytes([i]) * 16 for i in range(3)]
    r.record(0, names)
    assert r.pick(names).worker == 0
    r.mark_down(0)
    assert r.pick(names).worker == 1                 # the best match is down: next best
    assert r.matched(0, names) == 0                  # what it held is forgotten
    assert r.least_loaded() == 1 and r.pack(limit=2) == 1
    assert r.pick(names, exclude=[1]).worker == 2    # a retry excludes the failed worker
    r.mark_down(2)
    with pytest.raises(NoLiveWorker, match="down: \\[0, 2\\]"):
        r.pick(names, exclude=[1])
    r.mark_up(0)
    assert r.pick(names, exclude=[1]).worker == 0


def test_a_conversation_goes_back_to_its_decode_worker_until_its_batch_is_full() -> None:
    from pd_cache.cluster.decode_route import decode_balance
    from pd_cache.core.cluster_config import ClusterConfig

    threshold = decode_balance(ClusterConfig(decode_batch=4, balance_threshold=2))
    assert threshold == 3 and decode_balance(ClusterConfig(decode_batch=1)) == 2
    r = PrefixRouter(2, capacity_pages=64, balance_threshold=threshold)
    names = [bytes([i]) * 16 for i in range(5)]
    r.record(1, names[:4])   # turn 1 of the conversation decoded on worker 1
    for _ in range(3):
        r.begin(1)
    assert r.pick(names) == (1, 4)   # 3 in its batch, 0 elsewhere: still worker 1
    r.begin(1)
    assert r.pick(names) == (0, 0)   # a full batch of 4 more than the idle one: elsewhere


def test_a_decode_worker_another_front_filled_is_found_from_the_page_index() -> None:
    from pd_cache.cluster.index_route import held_by
    from pd_cache.core.events import IndexAnswer, WorkerHit

    r = PrefixRouter(3, capacity_pages=64, balance_threshold=2)
    names = [bytes([i]) * 16 for i in range(6)]
    r.record(0, names[:2])                              # this front's hints: worker 0, 2 pages
    found = IndexAnswer({"decode-2": WorkerHit(3, 2), "prefill-2": WorkerHit(6, 0)}, 6)
    known = held_by(found, "decode", 3)
    assert known == [0, 0, 5] and held_by(None, "decode", 3) == [0, 0, 0]
    assert r.pick(names) == (0, 2) and r.pick(names, known=known) == (2, 5)
    for _ in range(3):
        r.begin(2)
    assert r.pick(names, known=known) == (0, 2)         # overloaded: the balance still rules
    assert r.pick(names, exclude=[0], known=known) == (1, 0)


def test_spread_sends_a_busy_choice_to_an_idle_decode_worker_only_while_cores_idle() -> None:
    # One worker busy of two cores: the other core would idle beside its batch.
    assert spread(0, [5, 0], [0, 0], cores=2, live=[0, 1]) == 1
    # A prefill in flight fills the second core: keep the batch (and the affinity).
    assert spread(0, [5, 0], [1, 0], cores=2, live=[0, 1]) == 0
    assert spread(0, [0, 0], [0, 0], cores=2, live=[0, 1]) == 0     # the choice is idle
    assert spread(0, [5, 3], [0, 0], cores=4, live=[0, 1]) == 0     # no idle decode worker
    assert spread(0, [5, 0, 0], [0], cores=4, live=[0, 2]) == 2     # worker 1 is down
    assert spread(1, [0, 2, 0], [1, 1], cores=4, live=[0, 1, 2]) == 0


def test_decode_spread_cores_is_checked() -> None:
    assert ClusterConfig().decode_spread_cores == 0     # off unless asked for
    assert ClusterConfig(decode_spread_cores=-1).decode_spread_cores == -1
    with pytest.raises(ValueError, match="decode_spread_cores"):
        ClusterConfig(decode_spread_cores=-2)
