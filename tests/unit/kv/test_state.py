"""Recurrent-state checkpoints and the radix tree's state slots (no model, no storage)."""

from __future__ import annotations

import pytest
import torch

from pd_cache.core.config import KVLayout
from pd_cache.core.vocab import Tier
from pd_cache.kv import (
    OWNER,
    CacheInvariantError,
    CacheKey,
    PagePool,
    RadixCache,
    StatePool,
    checkpoints,
)
from pd_cache.tiering.chain import runs

PS = 2
LAYOUT = KVLayout(model_id="h", kv_dtype="float32", num_layers=1, page_size=PS,
                  num_kv_heads=1, head_dim=2, state_layers=2, state_dim=3)


@pytest.mark.parametrize("first,last,every,want", [
    (0, 9, 4, [3, 7, 9]), (0, 7, 4, [3, 7]), (4, 5, 4, [5]), (2, 2, 1, [2]),
    (5, 4, 4, []), (0, 2, 4, [2]),
])
def test_checkpoints_are_every_nth_page_and_the_last(first: int, last: int, every: int,
                                                     want: list[int]) -> None:
    assert checkpoints(first, last, every) == want


@pytest.mark.parametrize("n,size,ends,want", [
    (10, 4, {3, 7, 9}, [(0, 4), (4, 8), (8, 10)]),
    (10, 3, {4}, [(0, 3), (3, 5), (5, 8), (8, 10)]),
    (5, 128, (), [(0, 5)]),
    (0, 3, (), []),
])
def test_runs_end_at_checkpoints_and_batch_bounds(n: int, size: int, ends: object,
                                                 want: list[tuple[int, int]]) -> None:
    assert [(r.start, r.stop) for r in runs(n, size, ends)] == want  # type: ignore[arg-type]


def make_cache(device: int = 8, host: int = 8) -> RadixCache:
    return RadixCache(PagePool("device", device, LAYOUT), PagePool("host", host, LAYOUT),
                      states=StatePool(device + host, LAYOUT))


def pages(n: int) -> torch.Tensor:
    return torch.arange(n * 8, dtype=torch.float32).view(n, *LAYOUT.page_shape)


def state(v: float) -> torch.Tensor:
    return torch.full(LAYOUT.state_shape, v)


def test_a_match_resumes_at_its_deepest_node_with_a_state() -> None:
    cache = make_cache()
    k = CacheKey.build(list(range(12)), page_size=PS)             # 6 pages
    cache.insert(k, pages(6), states={1: state(1.0), 4: state(4.0)})
    match = cache.match_prefix(k)
    assert match.num_pages == 6 and cache.resume_pages(match) == 5
    assert torch.equal(cache.read_state(match, 5), state(4.0))
    short = cache.match_prefix(k, max_pages=4)
    assert cache.resume_pages(short) == 2
    with pytest.raises(ValueError, match="page 3 of the match keeps no state"):
        cache.read_state(match, 4)
    assert cache.states.usage() == {OWNER: 2}
    cache.check_invariants()


def test_state_slots_go_with_their_nodes_and_leaks_are_caught() -> None:
    cache = make_cache(device=4, host=0)
    k = CacheKey.build(list(range(8)), page_size=PS)              # 4 pages, all on device
    cache.insert(k, pages(4), states={3: state(3.0)})
    assert cache.num_states == 1
    cache.evict(Tier.DEVICE, 1)                                    # the leaf (and its state)
    assert cache.num_states == 0 and cache.states.usage() == {}
    cache.check_invariants()
    cache.states.alloc(1, OWNER)                                   # a slot no node holds
    with pytest.raises(CacheInvariantError, match="state: pool slots owned by 'radix'"):
        cache.check_invariants()


def test_a_state_of_the_wrong_shape_is_refused() -> None:
    cache = make_cache()
    k = CacheKey.build(list(range(4)), page_size=PS)
    with pytest.raises(ValueError, match=r"insert: states\[1\]: expected shape \[n, 2, 3\]"):
        cache.insert(k, pages(2), states={1: torch.zeros(3, 2)})
    assert cache.match_prefix(k).num_pages == 0                    # nothing was cached
    with pytest.raises(ValueError, match="has no recurrent state"):
        StatePool(4, KVLayout(model_id="p", kv_dtype="float32", num_layers=1, page_size=PS,
                              num_kv_heads=1, head_dim=2))
