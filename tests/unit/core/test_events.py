"""KV events on the publisher's side: the log, its split per index shard, and the
``Publisher``'s protocol with a shard (a gap or a refusal -> a snapshot)."""

from __future__ import annotations

from pd_cache.core.events import (
    REMOVED,
    STORED,
    EventBatch,
    EventLog,
    PagesRemoved,
    PagesStored,
    Publisher,
    shard_of,
    split,
)
from pd_cache.core.hashing import page_hashes

NAMES = page_hashes(list(range(64)), 4)   # 16 real chain names


def test_split_keeps_order_per_shard_and_merges_runs() -> None:
    entries = [(STORED, "device", NAMES[:8]), (STORED, "device", NAMES[8:]),
               (REMOVED, "host", NAMES[:4])]
    out = split(entries, 2)
    for k in range(2):
        mine = [n for n in NAMES if shard_of(n, 2) == k]
        assert out[k][0] == PagesStored("device", mine)   # both stored runs in one event
        assert out[k][1:] == [PagesRemoved("host", [n for n in NAMES[:4] if n in mine])] \
            or not [n for n in NAMES[:4] if n in mine]
    assert {len(out[0][0].names), len(out[1][0].names)} != {0}   # names spread over shards


class Shard:
    """A shard that accepts batches in sequence after a snapshot (as ``PageIndex`` does)."""

    def __init__(self) -> None:
        self.got: list[EventBatch] = []
        self.next: int | None = None
        self.refuse_next = False

    def send(self, shard: int, batch: EventBatch) -> bool:
        self.got.append(batch)
        if self.refuse_next:
            self.refuse_next, self.next = False, None
            return False
        if batch.snapshot or batch.seq == self.next:
            self.next = batch.seq + 1
            return True
        return False


def test_publisher_snapshots_first_then_sends_batches_and_snapshots_after_a_refusal() -> None:
    log, shard, now = EventLog(), Shard(), [100.0]
    held = {"device": list(NAMES[:2])}
    pub = Publisher("prefill-0", log, 1, shard.send, lambda: held, heartbeat_s=1.0,
                    clock=lambda: now[0])
    log.add(STORED, "device", NAMES[:2])
    pub.flush()                                   # first contact: a snapshot of what is held
    assert shard.got[-1].snapshot and shard.got[-1].events == [PagesStored("device",
                                                                          NAMES[:2])]
    now[0] = 100.5
    pub.flush()
    assert len(shard.got) == 1                    # nothing logged: nothing sent
    now[0] = 101.5
    pub.flush()                                   # a second of silence: a heartbeat
    assert shard.got[-1].seq == 1 and shard.got[-1].events == []
    log.add(STORED, "host", NAMES[2:3])
    pub.flush()
    last = shard.got[-1]
    assert not last.snapshot and last.seq == 2 and last.epoch == pub.epoch
    assert last.events == [PagesStored("host", NAMES[2:3])]
    shard.refuse_next = True                      # the shard restarted: it refuses
    log.add(REMOVED, "device", NAMES[:1])
    pub.flush()
    assert pub.stale == [True]
    held = {"device": list(NAMES[1:2]), "host": list(NAMES[2:3])}
    pub.flush()                                   # a snapshot replaces what was lost
    assert shard.got[-1].snapshot and shard.got[-1].seq == 4 and pub.stale == [False]


def test_an_unreachable_shard_gets_a_snapshot_once_it_answers() -> None:
    log, calls = EventLog(), []

    def send(shard: int, batch: EventBatch) -> bool:
        calls.append(batch)
        if len(calls) == 1:
            raise TimeoutError("index restarting")
        return True

    pub = Publisher("storage-0", log, 1, send, lambda: {"storage": NAMES[:3]})
    pub.flush()
    assert pub.stale == [True]
    pub.flush()
    assert calls[-1].snapshot and pub.stale == [False]
    assert calls[-1].events == [PagesStored("storage", list(NAMES[:3]))]


def test_a_snapshot_walk_that_races_the_engine_is_retried() -> None:
    log, sent = EventLog(), []
    walks = iter([RuntimeError("dictionary changed size during iteration"), {"device": []}])

    def held() -> dict[str, list[bytes]]:
        w = next(walks)
        if isinstance(w, Exception):
            raise w
        return w

    pub = Publisher("decode-0", log, 1, lambda k, b: sent.append(b) or True, held)
    pub.flush()
    assert sent == []
    pub.flush()
    assert sent[0].snapshot
