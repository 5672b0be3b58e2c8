"""v2 calls with sidecar pools: what a backend receives and accepts, per ``prefix_keys`` state.

An operation's keys are its longest key list (the KV pool's); a sidecar pool (a recurrent
``state`` pool, a sliding window) may cover only a trailing run of them, and its priors are
the operation's priors at those positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pd_cache.storage import (
    ExtraInfo,
    PoolHits,
    PoolTransfer,
    StorageBackend,
    usable_prefix,
)
from pd_cache.storage.batch import check_batch
from pd_cache.storage.client import StorageClient, _merge_exists, _share
from pd_cache.storage.disk import DiskBackend
from pd_cache.storage.memory import MemoryBackend
from tests.unit.storage.records import Chain, assert_same, layout_for
from tests.unit.tiering.fakes import Recorder

STATE = (3, 8)
# prefix_keys state -> how many pages of the chain come before the operation
MODES = {"off": None, "seed": 0, "after_two": 2}


class PriorSpy(MemoryBackend):
    """A memory backend that notes the prior it checks each key against, as it checks it:
    what the chain it was handed became inside the backend (``None``: nothing checked)."""

    def __init__(self) -> None:
        super().__init__(layout_for(), 1 << 24)
        self.checked: list[tuple[str, bytes, bytes | None]] = []

    def _absent(self, slot: Any, prior: bytes | None) -> Any:
        self.checked.append((slot[0], slot[1], prior))
        return super()._absent(slot, prior)

    def _put(self, slot: Any, record: Any, prior: bytes | None, *args: Any) -> bool:
        self.checked.append((slot[0], slot[1], prior))
        return super()._put(slot, record, prior, *args)

    def take(self) -> list[tuple[str, bytes, bytes | None]]:
        checked, self.checked = self.checked, []
        return checked


def chain_priors(chain: Chain, pool: str, lo: int, hi: int,
                 on: bool = True) -> list[tuple[str, bytes, bytes | None]]:
    """The (pool, key, prior) a backend must check for pages ``lo..hi`` of ``chain``."""
    return [(pool, chain.names[i], chain.priors[i] if on else None) for i in range(lo, hi)]


def info_for(chain: Chain, before: int | None) -> ExtraInfo:
    """``prefix_keys`` of an operation that starts after ``before`` pages (``None``: off)."""
    prefix = None if before is None else chain.names[:before]
    return ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed, request_id="r1")


def operation(chain: Chain, lo: int, state_pages: int,
              with_pages: bool = True) -> list[PoolTransfer]:
    """KV for pages ``lo..`` of ``chain`` and ``state`` for only the last ``state_pages``."""
    hi = len(chain.names)
    kv = PoolTransfer("kv", chain.names[lo:], chain.records[lo:] if with_pages else None)
    state = PoolTransfer("state", chain.names[hi - state_pages:],
                         chain.states[hi - state_pages:] if with_pages else None)
    return [kv, state]


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StorageBackend:
    if request.param == "memory":
        return MemoryBackend(layout_for(), 1 << 24)
    return DiskBackend(tmp_path / "l3", layout_for(), 1 << 24)


@pytest.mark.parametrize("mode", list(MODES))
def test_backend_receives_prefix_keys_as_given_and_accepts_a_trailing_sidecar(
        mode: str) -> None:
    before = MODES[mode]
    lo, on = before or 0, before is not None
    chain = Chain(layout_for(), lo + 4, state_shape=STATE)
    spy = PriorSpy()
    backend = Recorder(spy)
    if lo:  # the pages before the operation are stored by an earlier one
        assert backend.batch_set(chain.names[:lo], chain.records[:lo],
                                 info_for(chain, 0)) == [True] * lo
    backend.calls.clear()
    spy.take()
    info = info_for(chain, before)
    handed = info.prefix_keys
    kv, state = (chain_priors(chain, "kv", lo, lo + 4, on),
                 chain_priors(chain, "state", lo + 3, lo + 4, on))

    # what the backend received: per key, the prior of the chain the caller handed over
    assert backend.batch_set_v2(operation(chain, lo, 1), info) == [[True] * 4, [True]]
    assert spy.take() == kv + state
    hits = backend.batch_exists_v2(operation(chain, lo, 1, with_pages=False), info)
    assert spy.take() == kv + state
    got = backend.batch_get_v2(operation(chain, lo, 1, with_pages=False), info)
    assert spy.take() == kv + state
    assert backend.batch_exists(chain.names[lo:], info) == 4
    assert spy.take() == kv
    assert [g is not None for g in backend.batch_get(chain.names[lo:], info)] == [True] * 4
    assert spy.take() == kv
    # ... and holds the keys to it: after another chain's page, the same keys miss
    foreign = ExtraInfo(prefix_keys=Chain(layout_for(), 1, extra_key="b").names)
    assert backend.batch_exists(chain.names[lo:], foreign) == 0
    assert spy.take()[0] == ("kv", chain.names[lo], foreign.prefix_keys[-1])

    # the caller's lists are left as they were
    assert [op for op, *_ in backend.calls] == ["set", "exists", "get", "exists", "get", "exists"]
    for _, pools, _, prefix in backend.calls[:-1]:
        assert prefix == (None if before is None else chain.names[:before])
        assert pools[0] == ("kv", chain.names[lo:])
    assert (handed is None) == (mode == "off") and handed == (
        None if before is None else chain.names[:before])

    # what it answered: every page of both pools, the usable hit over the whole operation
    assert hits.per_pool == {"kv": 4, "state": 1} and hits.usable == 4
    for page, want in zip(got[0].pages, chain.records[lo:]):
        assert_same(page, want)
    assert_same(got[1].pages[0], chain.states[-1])
    assert usable_prefix(got) == 4
    stats = backend.stats()
    assert stats["miss/namespace_refused"] == stats["refused/namespace_refused"] == 1


def test_trailing_sidecar_round_trips(store: StorageBackend) -> None:
    chain = Chain(layout_for(), 4, state_shape=STATE)
    info = info_for(chain, 0)
    assert store.batch_set_v2(operation(chain, 0, 2), info) == [[True] * 4, [True] * 2]
    for state_pages in (1, 2):  # a reader may ask for fewer trailing state pages
        hits = store.batch_exists_v2(operation(chain, 0, state_pages, False), info)
        assert hits == PoolHits({"kv": 4, "state": state_pages}, 4,
                                {"state": [True] * state_pages})
    got = store.batch_get_v2(operation(chain, 0, 2, False), info)
    assert_same(got[1].pages[0], chain.states[2])
    assert_same(got[1].pages[1], chain.states[3])
    assert usable_prefix(got) == 4
    assert store.stats() == {"stored/": 6, "hit/": 6}


def test_missing_trailing_state_limits_the_usable_hit(store: StorageBackend) -> None:
    chain = Chain(layout_for(), 4, state_shape=STATE)
    info = info_for(chain, 0)
    assert store.batch_set_v2(operation(chain, 0, 1)[:1], info) == [[True] * 4]
    # no page of the operation has its state: a hybrid request could resume from none
    hits = store.batch_exists_v2(operation(chain, 0, 1, False), info)
    assert hits.per_pool == {"kv": 4, "state": 0} and hits.usable == 0
    got = store.batch_get_v2(operation(chain, 0, 1, False), info)
    assert got[1].pages == [None] and usable_prefix(got) == 0
    # the state of the last two pages, of which only the very last is stored: all four
    store.batch_set_v2([PoolTransfer("state", chain.names[3:], chain.states[3:])],
                       info_for(chain, 3))
    hits = store.batch_exists_v2(operation(chain, 0, 2, False), info)
    assert hits.per_pool == {"kv": 4, "state": 0} and hits.usable == 4
    assert hits.checkpoints == {"state": [False, True]}
    got = store.batch_get_v2(operation(chain, 0, 2, False), info)
    assert usable_prefix(got) == 4
    # an earlier page with its state is an end too: the longest prefix ending at one
    store.batch_set_v2([PoolTransfer("state", chain.names[1:2], chain.states[1:2])],
                       info_for(chain, 1))
    hits = store.batch_exists_v2([PoolTransfer("kv", chain.names[:3]),
                                  PoolTransfer("state", chain.names[:3])], info)
    assert hits.usable == 2 and hits.checkpoints == {"state": [False, True, False]}


def test_sidecar_priors_are_the_operations(store: StorageBackend) -> None:
    chain = Chain(layout_for(), 4, state_shape=STATE)
    other = Chain(layout_for(), 1, extra_key="tenant-b")
    # another namespace's seed: the operation's first page does not follow it
    wrong = ExtraInfo(prefix_keys=[], namespace_seed=other.seed)
    acks = store.batch_set_v2([PoolTransfer("kv", chain.names[:1], chain.records[:1]),
                               PoolTransfer("state", chain.names[:1], chain.states[:1])], wrong)
    assert acks == [[False], [False]]
    assert store.stats()["refused/namespace_refused"] == 2
    # a state record of page 3 under the operation's trailing key is checked against page 2
    store.batch_set_v2(operation(chain, 0, 1), info_for(chain, 0))
    gap = ExtraInfo(prefix_keys=chain.names[:1], namespace_seed=chain.seed)
    hits = store.batch_exists_v2([PoolTransfer("kv", chain.names[2:]),
                                  PoolTransfer("state", chain.names[3:])], gap)
    assert hits.per_pool == {"kv": 0, "state": 1} and hits.usable == 0


def test_sidecar_that_is_not_trailing_is_refused_with_the_pool_named(
        store: StorageBackend) -> None:
    chain = Chain(layout_for(), 4, state_shape=STATE)
    leading = [PoolTransfer("kv", chain.names, chain.records),
               PoolTransfer("state", chain.names[:2], chain.states[:2])]
    for info in (info_for(chain, 0), info_for(chain, 2)):
        with pytest.raises(ValueError, match=r"transfers\[1\].*'state'.*trailing"):
            store.batch_set_v2(leading, info)
        with pytest.raises(ValueError, match=r"'state'.*trailing"):
            store.batch_exists_v2([PoolTransfer("kv", chain.names[:3]),
                                   PoolTransfer("state", chain.names[3:])], info)
    assert store.usage().records == 0 and store.stats() == {}
    # feature off: no chain to check, each pool counts from its own first key, as before
    assert store.batch_set_v2(leading, None) == [[True] * 4, [True] * 2]
    hits = store.batch_exists_v2([PoolTransfer("kv", chain.names),
                                  PoolTransfer("state", chain.names[:2])])
    assert hits == PoolHits({"kv": 4, "state": 2}, 2, {"state": [True, True]})


def test_accumulated_batches_with_a_trailing_sidecar_leave_caller_lists_alone() -> None:
    chain = Chain(layout_for(), 6, state_shape=STATE)
    spy = PriorSpy()
    backend = Recorder(spy)
    prefix: list[bytes] = []
    for lo in range(0, 6, 3):  # two batches; each ends with the state of its last page
        batch = chain.names[lo:lo + 3]
        info = ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed)
        acks = backend.batch_set_v2([PoolTransfer("kv", batch, chain.records[lo:lo + 3]),
                                     PoolTransfer("state", batch[-1:], chain.states[lo + 2:
                                                                                    lo + 3])],
                                    info)
        assert acks == [[True] * 3, [True]]
        # the second batch is checked from the first one's last page, not from the seed
        assert spy.take() == (chain_priors(chain, "kv", lo, lo + 3)
                              + chain_priors(chain, "state", lo + 2, lo + 3))
        prefix = prefix + batch
    first, second = backend.calls[0][3], backend.calls[1][3]
    assert first == [] and second == chain.names[:3]  # as handed over, unchanged since
    assert backend.calls[0][2].prefix_keys == [] and len(prefix) == 6
    hits = backend.batch_exists_v2([PoolTransfer("kv", chain.names[3:]),
                                    PoolTransfer("state", chain.names[5:])],
                                   ExtraInfo(prefix_keys=chain.names[:3]))
    assert spy.take() == (chain_priors(chain, "kv", 3, 6)
                          + chain_priors(chain, "state", 5, 6))
    assert hits.usable == 3
    # a prefix one page short does not lead to the second batch
    assert backend.batch_exists(chain.names[3:], ExtraInfo(prefix_keys=chain.names[:2])) == 0


# a prefix ends at a page whose state is stored: pages 0-3 of KV, states after the last ones
@pytest.mark.parametrize("kv, state, usable", [
    ([1, 1, 1, 1], [1], 4),
    ([1, 1, 1, 1], [None], 0),            # no page of the operation has its state
    ([1, 1, None, None], [1], 0),         # page 1 ends the KV, its state was not asked
    ([1, 1, 1, 1], [None, 1], 4),         # page 3 has its state: all four
    ([1, 1, 1, 1], [1, None], 3),         # the last page with a state is page 2
    ([1, 1, 1, None], [1, 1], 3),         # KV ends at page 2, which has its state
    ([1, 1, 1, None], [None, 1], 0),      # page 3's state is no use without its KV
    ([1, 1, 1, 1], [1, None, 1, None], 3),
    ([1, 1, 1, 1], [], 0),                # a state pool asked for no page has no end
    ([None, 1, 1, 1], [1], 0),
])
def test_usable_prefix_ends_at_a_page_with_its_state(kv: list[Any], state: list[Any],
                                                     usable: int) -> None:
    chain = Chain(layout_for(), 4)
    result = [PoolTransfer("kv", chain.names, kv),
              PoolTransfer("state", chain.names[4 - len(state):], state)]
    assert usable_prefix(result) == usable
    # a pool of per-page data (anything but state) needs every page it covers
    result = [PoolTransfer("kv", chain.names, kv),
              PoolTransfer("scale", chain.names[4 - len(state):], state)]
    start = 4 - len(state)
    run = next((i for i, p in enumerate(kv) if p is None), 4)
    side = next((i for i, p in enumerate(state) if p is None), len(state))
    assert usable_prefix(result) == min(run, start + side)


def test_sharded_exists_ends_at_a_state_on_any_shard() -> None:
    """The client merges each shard's answer (real backends, the transport left out): a
    state stored on one shard is an end although the other shard has none."""
    chain = Chain(layout_for(), 8, state_shape=STATE)
    client = StorageClient([None, None], segment_pages=1)   # a page per segment: spread
    shards = [MemoryBackend(layout_for(), 1 << 24) for _ in range(2)]
    info = info_for(chain, 0)
    ask = [PoolTransfer("kv", chain.names), PoolTransfer("state", chain.names[4:])]
    for with_states in ([], [5], [5, 7]):
        kv = PoolTransfer("kv", chain.names, chain.records)
        states = PoolTransfer("state", [chain.names[i] for i in with_states],
                              [chain.states[i] for i in with_states])
        batches = check_batch([kv, states], None, "xxh3_128", with_pages=True)
        for s, parts in client.plan(batches, None).items():
            shards[s].batch_set_v2(_share(batches, parts))
        batches = check_batch(ask, info, "xxh3_128", with_pages=False)
        plan = client.plan(batches, info)
        answers = {s: shards[s].batch_exists_v2(_share(batches, parts))
                   for s, parts in plan.items()}
        hits = _merge_exists(batches, plan, answers)
        assert hits.usable == {(): 0, (5,): 6, (5, 7): 8}[tuple(with_states)]
        assert hits.checkpoints == {"state": [4 + i in with_states for i in range(4)]}
    assert {client.shard_of(n) for n in chain.names[4:]} == {0, 1}
