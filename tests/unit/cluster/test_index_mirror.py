"""A front's mirror of the page index: the shard's change feed (deltas, a log too short, a
restarted shard: snapshots), the copy's bound, and answers equal to the shard's own."""

from __future__ import annotations

from pd_cache.cluster.index import PageIndex, answer, locate
from pd_cache.cluster.index_feed import ChangeLog
from pd_cache.cluster.index_mirror import IndexMirror, ShardCopy
from pd_cache.core.events import EventBatch, IndexChanges, PagesRemoved, PagesStored
from pd_cache.core.hashing import page_hashes

NAMES = page_hashes(list(range(48)), 4)   # a 12-page chain


def feed(shard: PageIndex, copy: ShardCopy, now: float = 0.0) -> bool:
    """One poll of ``shard`` applied to ``copy``; whether it was a snapshot."""
    changes = shard.changes(copy.epoch, copy.version)
    copy.apply(changes, now)
    return changes.snapshot


def same(shard: PageIndex, copy: ShardCopy) -> None:
    asked, where = locate(NAMES, 1)
    assert answer([copy.view(asked[0])], where) == answer([shard.query(asked[0])], where)
    assert copy.state[0] == shard.masks


def test_the_log_gives_the_names_changed_since_a_version_until_it_no_longer_reaches() -> None:
    log = ChangeLog(bound=5)
    assert log.since(0) == set()
    log.add(NAMES[:2])
    log.add([])                       # nothing changed: no version
    log.add(NAMES[1:4])
    assert log.version == 2 and log.since(1) == set(NAMES[1:4])
    assert log.since(0) == set(NAMES[:4]) and log.since(3) is None   # ahead: not this epoch
    log.add(NAMES[4:6])               # 7 names logged > 5: version 1 goes
    assert log.floor == 1 and log.since(0) is None and log.since(1) == set(NAMES[1:6])


def test_a_copy_follows_deltas_forgotten_publishers_and_takes_a_snapshot_when_behind() -> None:
    shard, copy = PageIndex(max_entries=100), ShardCopy(bound=100)
    assert feed(shard, copy)          # a new copy: a snapshot (empty)
    shard.publish(EventBatch("prefill-0", 1, 0, [PagesStored("device", NAMES[:6]),
                                                 PagesStored("host", NAMES[:9])], True))
    shard.publish(EventBatch("storage-0", 7, 0, [PagesStored("storage", NAMES)], True))
    assert not feed(shard, copy)
    same(shard, copy)
    shard.publish(EventBatch("prefill-0", 1, 1, [PagesRemoved("device", NAMES[3:6]),
                                                 PagesRemoved("host", NAMES[7:])]))
    shard.publish(EventBatch("storage-0", 7, 1, [PagesRemoved("storage", NAMES[10:])]))
    assert not feed(shard, copy)
    same(shard, copy)
    assert copy.state[0].get(NAMES[11]) is None          # removed everywhere: gone
    # a publisher's new epoch drops its entries: a delta of every name it held
    assert not shard.publish(EventBatch("prefill-0", 2, 0, [PagesStored("device", NAMES)]))
    assert not feed(shard, copy)
    same(shard, copy)
    # more changes than the log keeps while the copy did not ask: a snapshot
    shard.feed = ChangeLog(bound=4)
    shard.feed.epoch, shard.feed.version = copy.epoch, copy.version
    shard.publish(EventBatch("storage-0", 7, 2, [PagesRemoved("storage", NAMES[:5])]))
    snapshots = copy.counts["snapshot"]
    assert feed(shard, copy) and copy.counts["snapshot"] == snapshots + 1
    same(shard, copy)


def test_a_restarted_shard_is_taken_whole_and_the_copy_keeps_the_shards_bound() -> None:
    shard, copy = PageIndex(), ShardCopy(bound=5)
    shard.publish(EventBatch("prefill-0", 1, 0, [PagesStored("device", NAMES[:4])], True))
    feed(shard, copy)
    same(shard, copy)
    restarted = PageIndex()           # a new process: a new epoch, empty
    restarted.publish(EventBatch("prefill-1", 3, 0, [PagesStored("host", NAMES[:8])], True))
    assert feed(restarted, copy)
    assert len(copy.state[0]) == 5 and copy.counts["dropped"] == 3   # bounded
    assert copy.state[1] == [("prefill-1", "host")]
    restarted.publish(EventBatch("prefill-1", 3, 1, [PagesRemoved("host", NAMES[:1]),
                                                     PagesStored("device", NAMES[9:11])]))
    assert not feed(restarted, copy)
    assert len(copy.state[0]) == 5 and copy.counts["dropped"] == 4   # one more had room
    # an answer of another epoch that is not a snapshot cannot be applied: out of sync
    copy.apply(IndexChanges(copy.epoch + 1, 1, [], [], []), 9.0)
    assert copy.synced_at == float("-inf") and copy.counts["failed"] == 1


def test_the_mirror_answers_as_the_shards_do_only_while_every_copy_is_fresh() -> None:
    now = [100.0]
    shards = [PageIndex() for _ in range(3)]
    mirror = IndexMirror([None] * 3, bound=100, max_age_s=2.0, clock=lambda: now[0])
    asked, where = locate(NAMES, 3)
    for k, shard in enumerate(shards):
        mine = [n for n in NAMES if n in asked[k]]
        shard.publish(EventBatch("prefill-1", 5, 0, [PagesStored("device", mine[:3]),
                                                     PagesStored("host", mine)], True))
    assert mirror.answer(NAMES) is None                  # never heard from a shard
    for shard, copy in zip(shards[:2], mirror.copies):
        feed(shard, copy, now[0])
    assert mirror.answer(NAMES) is None                  # one shard not yet
    feed(shards[2], mirror.copies[2], now[0])
    got = mirror.answer(NAMES)
    assert got is not None and got == answer([s.query(a) for s, a in zip(shards, asked)],
                                             where)
    assert got.workers["prefill-1"].pages == len(NAMES)
    now[0] += 2.5                                        # a copy past max_age_s: ask instead
    assert mirror.answer(NAMES) is None
    mirror.copies[0].lost()
    stats = mirror.stats()
    assert stats["answered"] == 1 and stats["unsynced"] == 3 and stats["failed"] == 1
    assert stats["entries"] == len(NAMES)
