"""The cache oracle against cases counted by hand (page size 4)."""

from __future__ import annotations

import pytest

from pd_cache.app.bench.oracle import (
    OracleRequest,
    lookup_pages,
    offloaded_pages,
    simulate,
)

PS = 4
A_IN = list(range(1, 10))                       # 9 tokens: pages a0=[1-4] a1=[5-8], 9 partial
A_OUT = [10, 11, 12]
B_IN = A_IN + A_OUT + [20, 21, 22, 23]          # 16 tokens: a0 a1 [9 10 11 12] [20-23]
C_IN = list(range(50, 59))                      # 9 tokens: c0 c1


def req(index: int, ids: list[int], out: list[int], sent: float, end: float | None,
        salt: str = "s") -> OracleRequest:
    return OracleRequest(index, salt, None, ids, out, sent, end)


def test_page_counts() -> None:
    assert [lookup_pages(n, PS) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]
    # decode has KV for every token but the last one drawn
    assert offloaded_pages(9, 3, PS) == 2     # 11 tokens with KV
    assert offloaded_pages(9, 4, PS) == 3     # 12
    assert offloaded_pages(8, 1, PS) == 2     # 8: the drawn token has none
    assert offloaded_pages(8, 0, PS) == 2     # nothing drawn: the prompt's full pages
    assert offloaded_pages(7, 2, PS) == 2


def stream() -> list[OracleRequest]:
    return [
        req(0, A_IN, A_OUT, 0.0, 1.0),
        req(1, C_IN, [60], 0.5, 0.8),
        req(2, B_IN, [1], 2.0, 2.5),
        req(3, C_IN, [1], 3.0, 3.5),             # C's prompt again
        req(4, C_IN, [1], 4.0, 4.5, salt="t"),   # the same tokens in another namespace
    ]


def test_ideal_and_lru_by_hand() -> None:
    """Capacity 3 pages; LRU order written least recent first, an access stamping its
    pages last page first.

    t=0   A sends: lookup a0 a1 -> miss; insert a1, a0            [a1 a0]
    t=0.5 C sends: miss; insert c1, c0 -> evict a1                 [a0 c1 c0]
    t=0.8 C ends: 9 + 1 - 1 = 9 tokens with KV: c0 c1 again       [a0 c1 c0]
    t=1   A ends: 9 + 3 - 1 = 11 tokens: a0 a1 (not [9 10 11 12]) -> evict c1   [c0 a1 a0]
    t=2   B sends: looks up (16 - 1) // 4 = 3 pages: a0 a1 hit, [9 10 11 12] miss -> 8;
          touch a1 a0, insert b3 b2 a1 a0 -> evict c0, b3          [b2 a1 a0]
          (an infinite cache also hits 8: A never stored its third page)
    t=2.5 B ends: 16 tokens with KV, 4 pages, inserted b3 b2 a1 a0 -> evict b2  [b3 a1 a0]
    t=3   C's prompt again: ideal hits c0 c1 -> 8; LRU evicted both -> 0
    t=4   the same tokens under salt "t": 0 in both
    """
    result = simulate(stream(), page_size=PS, capacity_pages=3)
    assert result.ideal_hit_tokens == {0: 0, 1: 0, 2: 8, 3: 8, 4: 0}
    assert result.lru_hit_tokens == {0: 0, 1: 0, 2: 8, 3: 0, 4: 0}
    assert result.prompt_tokens == 9 + 9 + 16 + 9 + 9
    assert result.ideal_hit_rate == pytest.approx(16 / 52)
    assert result.lru_hit_rate == pytest.approx(8 / 52)


def test_lru_evicts_a_chain_from_its_tail() -> None:
    """Capacity 4. A stores x0 x1 x2; D's prompt shares only x0; E brings two new pages.
    A page is never older than the pages after it in its chain, so eviction takes A's
    tail (x2, then x1) and A still finds x0.

    t=0 A: insert x2 x1 x0                       [x2 x1 x0]
    t=1 D: lookup x0 hit -> 4; insert d1 x0      [x2 x1 d1 x0]    (d1 = D's second page)
    t=2 E: insert e1 e0 -> evict x2, x1          [d1 x0 e1 e0]
    t=3 A again: looks up (12 - 1) // 4 = 2 pages: x0 hit, x1 evicted -> 4 (ideal 8)
    """
    a = list(range(100, 112))
    d = a[:4] + [7, 7, 7, 7, 7]
    e = list(range(200, 209))
    stream = [req(0, a, [], 0.0, None), req(1, d, [], 1.0, None), req(2, e, [], 2.0, None),
              req(3, a, [], 3.0, None)]
    result = simulate(stream, page_size=PS, capacity_pages=4)
    assert result.lru_hit_tokens == {0: 0, 1: 4, 2: 0, 3: 4}
    assert result.ideal_hit_tokens == {0: 0, 1: 4, 2: 0, 3: 8}


def test_an_end_comes_before_a_send_at_the_same_time() -> None:
    # 9 + 3 - 1 = 11 tokens with KV; the next prompt (16 tokens) finds 2 pages either way,
    # but with a 4-token answer A stores a third page that B (sent at A's end) finds
    a_out = [10, 11, 12, 13]
    b_in = A_IN + a_out + [20, 21, 22]
    stream = [req(0, A_IN, a_out, 0.0, 1.0), req(1, b_in, [], 1.0, None)]
    assert simulate(stream, page_size=PS).ideal_hit_tokens == {0: 0, 1: 12}
    late = [req(0, A_IN, a_out, 0.0, 1.5), req(1, b_in, [], 1.0, None)]
    assert simulate(late, page_size=PS).ideal_hit_tokens == {0: 0, 1: 8}   # prompt pages only


def test_requests_sent_together_see_each_other_in_index_order() -> None:
    stream = [req(1, A_IN, [], 0.0, None), req(0, A_IN, [], 0.0, None)]
    assert simulate(stream, page_size=PS).ideal_hit_tokens == {0: 0, 1: 8}


def test_unfinished_requests_store_only_their_prompt_and_no_capacity_means_no_lru() -> None:
    stream = [req(0, A_IN, A_OUT + [13], 0.0, None), req(1, B_IN, [], 5.0, None)]
    result = simulate(stream, page_size=PS)
    assert result.ideal_hit_tokens == {0: 0, 1: 8}
    assert result.lru_hit_tokens is None and result.lru_hit_rate is None


def test_zero_capacity_never_hits_and_empty_stream() -> None:
    result = simulate(stream(), page_size=PS, capacity_pages=0)
    assert set(result.lru_hit_tokens.values()) == {0}
    empty = simulate([], page_size=PS, capacity_pages=2)
    assert (empty.prompt_tokens, empty.ideal_hit_rate, empty.lru_hit_rate) == (0, 0.0, 0.0)


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match="^page_size: "):
        simulate(stream(), page_size=0)
    with pytest.raises(ValueError, match="^capacity_pages: "):
        simulate(stream(), page_size=PS, capacity_pages=-1)
    with pytest.raises(ValueError, match="^end_s: request 0 ended at 0.5"):
        simulate([req(0, A_IN, [], 1.0, 0.5)], page_size=PS)
    with pytest.raises(ValueError, match="^requests: two requests share an index"):
        simulate([req(0, A_IN, [], 0.0, None)] * 2, page_size=PS)
    with pytest.raises(ValueError, match="^cache_salt: "):
        simulate([req(0, A_IN, [], 0.0, None, salt="")], page_size=PS)
    with pytest.raises(ValueError, match="^algo: "):
        simulate(stream(), page_size=PS, algo="md5")
