"""The cache oracle: how many prompt tokens each request of a finished run could have found
cached, computed from the request stream alone.

Pages are named as the server names them (``compute_prefix_hash`` in the request's
namespace), and stored and looked up by the server's page rule for a request with ``n``
prompt and ``m`` generated tokens, page size ``P``::

    lookup (at sent_s)   the first (n - 1) // P pages: the last prompt token is always
                         computed (its logits give the first token); hits are consecutive
                         from page 0
    prefill (at sent_s)  the prompt's n // P full pages
    decode (at end_s)    the full pages of (prompt + output)[:n + m - 1] (m = 0: n // P):
                         decode never computes the KV of the last token it draws, and the
                         offload manager writes only pages whose every token has KV

Two caches replay those events in time order. ``ideal`` never evicts: an upper bound, also
because it stores a prompt's pages the moment it is sent (the server has them once
prefill is done) and needs no transfer between workers. ``lru`` holds ``capacity_pages``
pages and evicts the least recently used page; a lookup refreshes the pages it hit and an
insert refreshes what it inserts. Every access touches a prefix of a chain and stamps it
last page first, so a page is never older than the pages after it in its chain: LRU takes
a chain from its tail, never leaving pages that follow an evicted one (as L3's
``TailFirst`` does; stamping first page first would evict a chain's head and leave its
tail unreachable yet cached).

At equal times, ends come before sends (a request sent the moment its predecessor ended
finds the predecessor's answer), then by request index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pd_cache.core.config import CacheConfig
from pd_cache.core.fields import check_int_at_least, check_positive_int
from pd_cache.core.request import Req, compute_prefix_hash

DEFAULT_ALGO = CacheConfig().hash_algo


class OracleRequest(NamedTuple):
    """One request as it ran: its namespace, prompt and answer, and when it was sent and
    finished (``end_s = None``: it never finished, so decode stored nothing)."""

    index: int
    cache_salt: str | None
    extra_key: str | None
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    sent_s: float
    end_s: float | None


class OracleResult(NamedTuple):
    """Cached prompt tokens per request index, for an infinite cache (``ideal``: a request's
    expected cached tokens) and an LRU cache (``None`` without a capacity); hit rates are
    hit tokens / ``prompt_tokens`` over all requests."""

    ideal_hit_tokens: dict[int, int]
    lru_hit_tokens: dict[int, int] | None
    prompt_tokens: int
    ideal_hit_rate: float
    lru_hit_rate: float | None


def lookup_pages(num_prompt: int, page_size: int) -> int:
    """Pages a prompt of ``num_prompt`` tokens may reuse (the engine's ``usable``)."""
    return (num_prompt - 1) // page_size


def offloaded_pages(num_prompt: int, num_output: int, page_size: int) -> int:
    """Full pages decode stores after generating ``num_output`` tokens (``DecodeOffloadManager``:
    the prompt's at start, then every full page of tokens whose KV was computed)."""
    return (num_prompt + max(num_output - 1, 0)) // page_size


class _Ideal:
    def __init__(self) -> None:
        self.pages: set[bytes] = set()

    def lookup(self, names: Sequence[bytes]) -> int:
        return next((i for i, name in enumerate(names) if name not in self.pages), len(names))

    def insert(self, names: Iterable[bytes]) -> None:
        self.pages.update(names)


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[bytes, None] = OrderedDict()   # least recent first

    def lookup(self, names: Sequence[bytes]) -> int:
        hit = next((i for i, name in enumerate(names) if name not in self.pages), len(names))
        self._touch(names[:hit])
        return hit

    def insert(self, names: Sequence[bytes]) -> None:
        self._touch(names)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)

    def _touch(self, names: Sequence[bytes]) -> None:
        for name in reversed(names):
            self.pages[name] = None
            self.pages.move_to_end(name)


def _names(req: OracleRequest, page_size: int, algo: str) -> list[bytes]:
    """Names of every page the request stores: the prompt's, then decode's (if it ended)."""
    n, ids = len(req.input_ids), list(req.input_ids)
    pages = n // page_size
    if req.end_s is not None:
        pages = offloaded_pages(n, len(req.output_ids), page_size)
        ids += list(req.output_ids)
    owner = Req(rid=f"bench-{req.index}", input_ids=list(req.input_ids),
                cache_salt=req.cache_salt, extra_key=req.extra_key)
    return compute_prefix_hash(owner, ids[:pages * page_size], page_size=page_size, algo=algo)


def _events(requests: Sequence[OracleRequest]) -> list[tuple[float, int, int, int]]:
    """``(time, 0 end | 1 send, request index, position)`` in replay order."""
    events = []
    for pos, req in enumerate(requests):
        events.append((float(req.sent_s), 1, req.index, pos))
        if req.end_s is not None:
            if not req.end_s >= req.sent_s:
                raise ValueError(f"end_s: request {req.index} ended at {req.end_s!r}, "
                                 f"before it was sent at {req.sent_s!r}")
            events.append((float(req.end_s), 0, req.index, pos))
    return sorted(events)


def simulate(requests: Sequence[OracleRequest], *, page_size: int, algo: str = DEFAULT_ALGO,
             capacity_pages: int | None = None) -> OracleResult:
    """Replay ``requests`` (any order, distinct indices) through an infinite cache and, with
    ``capacity_pages``, an LRU cache of that many pages. ``ValueError`` for a bad field."""
    check_positive_int("page_size", page_size)
    if capacity_pages is not None:
        check_int_at_least("capacity_pages", capacity_pages, 0)
    if len({req.index for req in requests}) != len(requests):
        raise ValueError("requests: two requests share an index")
    names = [_names(req, page_size, algo) for req in requests]
    caches = {"ideal": _Ideal()}
    if capacity_pages is not None:
        caches["lru"] = _LRU(capacity_pages)
    hits: dict[str, dict[int, int]] = {kind: {} for kind in caches}
    for _, is_send, index, pos in _events(requests):
        n = len(requests[pos].input_ids)
        for kind, cache in caches.items():
            if is_send:
                hits[kind][index] = cache.lookup(names[pos][:lookup_pages(n, page_size)]) \
                    * page_size
                cache.insert(names[pos][:n // page_size])
            else:
                cache.insert(names[pos])
    prompt_tokens = sum(len(req.input_ids) for req in requests)

    def rate(kind: str) -> float:
        return sum(hits[kind].values()) / prompt_tokens if prompt_tokens else 0.0

    lru = hits.get("lru")
    return OracleResult(hits["ideal"], lru, prompt_tokens, rate("ideal"),
                        rate("lru") if lru is not None else None)
