"""The reader's side of lent records: batched verification and threaded checksums (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_cache.storage import reader, spread
from pd_cache.storage.reader import Checksummer, receive
from pd_cache.storage.record import PageRecord, checksums, verify, verify_all
from pd_cache.storage.shared import SharedPages
from tests.unit.storage.records import layout_for, page


def damaged(rec: PageRecord) -> PageRecord:
    payload = rec.payloads[0].clone()
    payload.view(torch.uint8).view(-1)[-1] ^= 0x01   # the last byte: every byte counts
    return PageRecord(rec.header, (payload,))


def test_verify_all_matches_verify_record_by_record() -> None:
    layout = layout_for()
    recs = [page(layout, seed=i) for i in range(6)]
    recs[1] = damaged(recs[1])
    names = [r.name for r in recs]
    names[3] = names[2]                                       # asked under another name
    priors: list[bytes | None] = [r.header.prior for r in recs]
    priors[4] = recs[0].name                                  # not its chain
    got = verify_all(recs, names, priors, layout, "xxh3_128", pool="kv")
    want = [verify(r, layout, "xxh3_128", name=n, prior=p, pool="kv")
            for r, n, p in zip(recs, names, priors)]
    assert got == want
    assert [g is None for g in got] == [True, False, True, False, False, True]
    assert "checksum mismatch" in (got[1] or "")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_checksummer_splits_large_batches_and_keeps_order(monkeypatch: pytest.MonkeyPatch,
                                                          threads: int) -> None:
    monkeypatch.setattr(spread, "PARALLEL_MIN_BYTES", 1)
    tensors = [torch.arange(n * 64, dtype=torch.float32) for n in range(1, 8)]
    hasher = Checksummer(threads)
    assert hasher(tensors) == checksums(tensors)
    assert (hasher._pool is not None) == (threads > 1)
    with pytest.raises(ValueError, match="threads"):
        Checksummer(0)


def test_receive_verifies_each_page_and_names_the_bad_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layout = layout_for()
    recs = [page(layout, seed=i) for i in range(4)]
    blocks: list[Any] = [(recs[0], damaged(recs[1])), (recs[2], recs[3]), None]
    monkeypatch.setattr(reader, "_fetch", lambda refs, deadline: (blocks, None, ""))
    # a miss, two pages of block 0 (one damaged), a position past block 1, a lost block
    shared = SharedPages("kv", [None, (0, 0), (0, 1), (1, 5), (1, 1), (2, 0)], lent=True,
                         blocks=["b0", "b1", "b2"])
    keys = [recs[3].name, recs[0].name, recs[1].name, recs[2].name, recs[3].name,
            recs[2].name]
    got = receive(shared, keys, [None] * 6, layout, "xxh3_128", None,
                  hash_all=Checksummer(2))
    assert [p is not None for p in got.pages] == [False, True, False, False, True, False]
    assert got.pages[1] is recs[0] and got.pages[4] is recs[3]
    assert got.bad == [recs[1].name, recs[2].name] and got.lost == 1


def test_records_sent_by_value_are_verified_here_too() -> None:
    """A disk shard sends records by value: the reader checksums the bytes it received,
    so a record damaged after the shard verified it is a miss, never served."""
    layout = layout_for()
    recs = [page(layout, seed=i) for i in range(3)]
    shared = SharedPages("kv", [recs[0], damaged(recs[1]), None, "junk"], layout=layout)
    keys = [recs[0].name, recs[1].name, recs[2].name, recs[2].name]
    got = receive(shared, keys, [r.header.prior for r in recs] + [None], layout, "xxh3_128",
                  deadline=None)
    assert got.pages == [recs[0], None, None, None]
    assert got.bad == [recs[1].name, recs[2].name] and got.lost == 0 and got.reason is None
