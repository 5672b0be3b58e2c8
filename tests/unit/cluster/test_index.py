"""The page index (one shard, and answers merged from several), fed as publishers feed it,
and routing by cost from its answer."""

from __future__ import annotations

import pytest

from pd_cache.cluster.index import PageIndex, answer, locate
from pd_cache.cluster.index_route import RouteWeights, cost, home_rank, pick
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.events import (
    EventBatch,
    IndexAnswer,
    PagesRemoved,
    PagesStored,
    WorkerHit,
    shard_of,
)
from pd_cache.core.hashing import page_hashes

NAMES = page_hashes(list(range(40)), 4)   # a 10-page chain


def batch(pub: str, seq: int, *events: object, epoch: int = 1,
          snapshot: bool = False) -> EventBatch:
    return EventBatch(pub, epoch, seq, list(events), snapshot)


def ask(shards: list[PageIndex], names: list[bytes]) -> IndexAnswer:
    asked, where = locate(names, len(shards))
    return answer([s.query(a) for s, a in zip(shards, asked)], where)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_answers_each_workers_prefix_by_tier_and_l3s(num_shards: int) -> None:
    shards = [PageIndex() for _ in range(num_shards)]

    def publish(b: EventBatch) -> None:
        for k, s in enumerate(shards):
            mine = [type(e)(e.tier, [n for n in e.names if shard_of(n, num_shards) == k])
                    for e in b.events]
            assert s.publish(EventBatch(b.publisher, b.epoch, b.seq, mine, b.snapshot))

    publish(batch("prefill-0", 0, PagesStored("device", NAMES[:3]),
                  PagesStored("host", NAMES[:6]), snapshot=True))
    publish(batch("prefill-1", 0, PagesStored("host", NAMES[:2]), snapshot=True))
    publish(batch("storage-0", 0, PagesStored("storage", NAMES[:8:2]), snapshot=True))
    publish(batch("storage-1", 0, PagesStored("storage", NAMES[1:8:2]), snapshot=True))
    got = ask(shards, NAMES)
    assert got == IndexAnswer({"prefill-0": WorkerHit(3, 3), "prefill-1": WorkerHit(0, 2)}, 8)
    publish(batch("prefill-0", 1, PagesRemoved("device", NAMES[2:3]),
                  PagesRemoved("host", NAMES[4:])))
    publish(batch("storage-1", 1, PagesRemoved("storage", NAMES[3:4])))
    got = ask(shards, NAMES)
    assert got.workers["prefill-0"] == WorkerHit(2, 2) and got.l3_pages == 3
    assert ask(shards, list(reversed(NAMES))).workers == {}   # a prefix starts at page 0


def test_gap_and_new_epoch_want_a_snapshot_and_a_new_epoch_drops_the_old_entries() -> None:
    index = PageIndex()
    assert not index.publish(batch("decode-0", 0, PagesStored("device", NAMES)))  # unknown
    assert index.publish(batch("decode-0", 0, PagesStored("device", NAMES), snapshot=True))
    assert index.publish(batch("decode-0", 1, PagesRemoved("device", NAMES[5:])))
    assert not index.publish(batch("decode-0", 3, PagesRemoved("device", NAMES[:1])))  # gap
    assert index.entries() == 5                  # a gap keeps what it had until the snapshot
    assert index.publish(batch("decode-0", 4, PagesStored("host", NAMES[:2]), snapshot=True))
    assert ask([index], NAMES).workers == {"decode-0": WorkerHit(0, 2)}
    # the worker restarted: a batch of its new epoch is refused and its entries go at once
    assert not index.publish(batch("decode-0", 0, PagesStored("device", NAMES), epoch=2))
    assert index.entries() == 0 and ask([index], NAMES).workers == {}


def test_entries_are_bounded_and_a_name_held_twice_is_one_entry() -> None:
    index = PageIndex(max_entries=4)
    assert index.publish(batch("prefill-0", 0, PagesStored("device", NAMES[:3]),
                               PagesStored("host", NAMES[:3]), snapshot=True))
    assert index.publish(batch("prefill-1", 0, PagesStored("device", NAMES), snapshot=True))
    assert index.entries() == 4 and index.counts["dropped"] == 6
    assert ask([index], NAMES).workers["prefill-1"] == WorkerHit(4, 0)


W = RouteWeights(compute_ms=2.0, host_ms=0.05, l3_ms=0.3, queue_ms=25.0)


def test_cost_counts_recompute_loads_and_queue() -> None:
    found = IndexAnswer({"prefill-0": WorkerHit(2, 4)}, 8)
    # 10 pages: 2 device (free), 4 host, 2 more from L3, 2 recomputed, 1 in flight
    assert cost(found, "prefill-0", 10, 1, W) == pytest.approx(2 * 2.0 + 4 * 0.05 + 2 * 0.3
                                                              + 25.0)
    assert cost(found, "prefill-1", 10, 0, W) == pytest.approx(8 * 0.3 + 2 * 2.0)


def test_pick_prefers_what_is_cheapest_to_load_then_the_shorter_queue() -> None:
    found = IndexAnswer({"prefill-0": WorkerHit(0, 40), "prefill-1": WorkerHit(40, 0)}, 0)
    assert pick(found, "prefill", 50, [0, 0], [0, 1], W).worker == 1   # device beats host
    assert pick(found, "prefill", 50, [0, 1], [0, 1], W).worker == 0   # a queue costs more
    assert pick(found, "prefill", 50, [0, 0], [0], W).worker == 0      # only the live ones
    l3 = IndexAnswer({}, 50)                                           # all in L3: by load
    assert pick(l3, "prefill", 50, [2, 1], [0, 1], W).worker == 1
    assert pick(IndexAnswer({}, 0), "prefill", 5, [0, 0], [0, 1], W).matched_pages == 0


def test_a_queue_within_the_balance_costs_nothing_beyond_it_each_request_does() -> None:
    found = IndexAnswer({"prefill-0": WorkerHit(0, 40), "prefill-1": WorkerHit(40, 0)}, 0)
    w = W._replace(balance=2)
    assert pick(found, "prefill", 50, [0, 2], [0, 1], w).worker == 1   # 2 ahead: still 1
    assert pick(found, "prefill", 50, [0, 3], [0, 1], w).worker == 0   # 1 beyond: 25 ms
    assert cost(found, "prefill-1", 50, 1, w) == pytest.approx(10 * 2.0 + 25.0)


def test_an_l3_page_is_priced_as_a_load_under_every_policy() -> None:
    # prefill waits for the pages the index vouches for, under best_effort too
    for policy in ("wait_complete", "best_effort"):
        w = RouteWeights.of(ClusterConfig(prefetch_policy=policy))
        assert (w.l3_ms, w.balance) == (0.3, 2)
        # worker 0 holds the prompt on host with one request beyond the balance; L3 has it
        found = IndexAnswer({"prefill-0": WorkerHit(0, 32)}, 32)
        assert pick(found, "prefill", 32, [3, 0], [0, 1], w).worker == 1    # L3 is cheap
        assert pick(found, "prefill", 32, [2, 0], [0, 1], w).worker == 0    # within balance


def test_a_prompt_no_worker_holds_goes_to_the_least_loaded_then_home() -> None:
    w, nobody = W._replace(balance=2), IndexAnswer({}, 0)
    homes = set()
    for first in page_hashes(list(range(64)), 4):     # 16 prompts' first pages
        one_front = pick(nobody, "prefill", 8, [1, 1, 1], [0, 1, 2], w, first=first)
        other_front = pick(nobody, "prefill", 8, [0, 0, 0], [0, 1, 2], w, first=first)
        assert one_front == other_front                # equal loads: the same home
        homes.add(one_front.worker)
    assert homes == {0, 1, 2}
    first = NAMES[0]
    home = pick(nobody, "prefill", 8, [0, 0, 0], [0, 1, 2], w, first=first).worker
    busier = [1 if k == home else 0 for k in range(3)]
    assert pick(nobody, "prefill", 8, busier, [0, 1, 2], w, first=first).worker != home
    assert home_rank(first, home) == home_rank(first, home)
    # a worker holding the prompt keeps it while its queue is within the balance
    held = IndexAnswer({f"prefill-{home}": WorkerHit(8, 0)}, 0)
    assert pick(held, "prefill", 8, [2 if k == home else 0 for k in range(3)], [0, 1, 2],
                w, first=first).worker == home


def test_pages_routed_but_not_yet_published_count_as_held() -> None:
    found = IndexAnswer({"prefill-0": WorkerHit(0, 2)}, 0)
    assert pick(found, "prefill", 32, [1, 0], [0, 1], W).worker == 1   # index alone: idle 1
    route = pick(found, "prefill", 32, [1, 0], [0, 1], W, hinted=[32, 0])
    assert route == (0, 32)        # this front just sent the prompt there: it will hold it
