"""The router's pure logic: prefix-aware prefill routing, decode packing, the ledger."""

from __future__ import annotations

import pytest

from pd_cache.cluster.router import PrefixRouter, ProvenanceLedger
from pd_cache.core.hashing import page_hashes

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


def test_ledger_flags_names_shared_between_namespaces() -> None:
    ledger = ProvenanceLedger()
    a, b = ("lora", None), (None, "t")
    own = page_hashes(range(8), PS, extra_key="lora")
    ledger.add(a, own)
    assert ledger.check(a, own) == (0, 0)
    assert ledger.check(b, own) == (2, 0)  # b got pages produced only in a
    # A naming bug that ignored the namespace would give b the same names: flagged too.
    ledger.add(b, own[:1])
    assert ledger.check(a, own) == (1, 0) and ledger.shared_names() == 1
    assert ledger.check(a, [b"\x00" * 16]) == (0, 1)


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
