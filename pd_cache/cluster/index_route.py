"""Routing prefill from the cluster page index, with the router's own hints as fallback.

Every front (ingress replica) asks the same index (``pd_cache.cluster.index``), so two
replicas route as one would. For each live prefill worker ``w`` the cost of serving a
prompt of ``N`` full pages, of which ``w`` holds ``d`` on device and ``h`` on host and L3
holds the first ``L``::

    l3(w)     = max(0, L - d - h)                 pages L3 adds after w's own
    excess(w) = max(0, in_flight(w) - min over live workers of in_flight - balance)
    cost(w)   = compute_ms x (N - d - h - l3(w))  recomputed
              + host_ms x h + l3_ms x l3(w)       loaded (device pages cost nothing)
              + queue_ms x excess(w)              its queue beyond the balance (this front's)

Pages this front routed to ``w`` that the index does not show yet (its hints) count as
device pages. ``balance`` is the hint router's ``balance_threshold``: a queue within it
costs nothing, so a shared prefix keeps its worker as it does with the hints. An L3 page
costs ``l3_ms`` whatever the prefetch policy: prefill is handed the index's ``l3_pages`` and
waits for those pages (under ``best_effort`` as ``timeout`` does, ``Prefetcher.policy``), so
a load is what it costs, not a recompute. The least
cost wins, then the least loaded (new prompts spread over the workers' caches), then the
prompt's *home* worker: the live worker ranked first by a hash of the
prompt's first page name and the worker's id (rendezvous), the same in every front, so two
fronts that see no holder yet send one system prompt to one worker. An index that does not
answer within ``index_timeout_s`` (dead, restarting, slow) leaves the choice to the local
hints (``PrefixRouter.pick``), which every front keeps as before.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from pd_cache.cluster.index import ShardView, answer, index_bound, locate
from pd_cache.cluster.index_mirror import IndexMirror
from pd_cache.cluster.router import PrefixRouter, Route
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.events import IndexAnswer


class RouteWeights(NamedTuple):
    compute_ms: float
    host_ms: float
    l3_ms: float
    queue_ms: float
    balance: int = 0

    @classmethod
    def of(cls, config: ClusterConfig) -> RouteWeights:
        """The config's weights."""
        return cls(config.route_compute_ms, config.route_host_ms, config.route_l3_ms,
                   config.route_queue_ms, config.balance_threshold)


class Asked(NamedTuple):
    """The index's answer for one request's names, asked once per attempt and shared by the
    decode and prefill choices (``None``: no index, nothing to choose, or no answer in
    time)."""

    answer: IndexAnswer | None


class IndexRoute(NamedTuple):
    """The chosen worker, its cached pages, and the leading pages L3 holds (``None``: the
    index did not answer)."""

    worker: int
    matched_pages: int
    l3_pages: int | None


def cost(found: IndexAnswer, publisher: str, num_pages: int, excess: int,
         w: RouteWeights, hinted: int = 0) -> float:
    """The module docstring's ``cost(w)`` of ``publisher`` (e.g. ``prefill-0``); ``excess``:
    its requests in flight beyond the balance; ``hinted``: the pages this front routed
    there, which may not be published yet (counted on device)."""
    hit = found.workers.get(publisher)
    device, host = (hit.device, hit.host) if hit is not None else (0, 0)
    device += max(0, hinted - device - host)
    l3 = max(0, found.l3_pages - device - host)
    recompute = max(0, num_pages - device - host - l3)
    return w.compute_ms * recompute + w.host_ms * host + w.l3_ms * l3 + w.queue_ms * excess


def held_by(found: IndexAnswer | None, role: str, n: int) -> list[int]:
    """The leading pages of the request each of ``n`` workers of ``role`` holds, device and
    host, as the index answered (all 0 without an answer)."""
    hits = found.workers if found is not None else {}
    return [hit.pages if (hit := hits.get(f"{role}-{k}")) is not None else 0
            for k in range(n)]


def home_rank(first: bytes, worker: int) -> bytes:
    """Rendezvous rank of ``worker`` for a prompt whose first page is named ``first``:
    the least is its home, the same in every process."""
    return hashlib.blake2b(first + worker.to_bytes(4, "little"), digest_size=8).digest()


def pick(found: IndexAnswer, role: str, num_pages: int, loads: Sequence[int],
         live: Sequence[int], w: RouteWeights, hinted: Sequence[int] = (),
         first: bytes = b"") -> Route:
    """The live worker of least cost, then the prompt's home (``first``: its first page
    name); its cached pages as the index (or, where more, this front's ``hinted`` pages
    per worker) has them."""
    hints = list(hinted) or [0] * len(loads)
    least = min(loads[k] for k in live)

    def key(k: int) -> tuple[float, int, bytes]:
        excess = max(0, loads[k] - least - w.balance)
        return (cost(found, f"{role}-{k}", num_pages, excess, w, hints[k]), loads[k],
                home_rank(first, k))

    best = min(live, key=key)
    hit = found.workers.get(f"{role}-{best}")
    return Route(best, max(hit.pages if hit is not None else 0, hints[best]))


class IndexClient:
    """Asks the index shards about a request's names, within a deadline."""

    def __init__(self, shards: Sequence[Any], timeout_s: float) -> None:
        self.shards, self.timeout_s = list(shards), timeout_s

    async def lookup(self, names: Sequence[bytes]) -> IndexAnswer | None:
        """The index's answer, or ``None`` if any shard did not answer in time."""
        n = len(self.shards)
        asked, where = locate(names, n)
        calls = [asyncio.wrap_future(self.shards[k].query.remote(asked[k]).future())
                 if asked[k] else _empty() for k in range(n)]
        try:
            views = await asyncio.wait_for(asyncio.gather(*calls), self.timeout_s)
        except Exception:  # noqa: BLE001 - dead, restarting or slow: local hints instead
            return None
        return answer([ShardView(*v) for v in views], where)


async def _empty() -> ShardView:
    return ShardView([], [])


def index_mirror(config: ClusterConfig, shards: Sequence[Any]) -> IndexMirror | None:
    """A front's mirror of the index ``shards``, its feed started (``None``: no index, or
    ``index_mirror_s`` 0)."""
    if not shards or not config.index_mirror_s:
        return None
    return IndexMirror(shards, index_bound(config), config.index_mirror_s).start()


class IndexRouting:
    """The prefill choice of ``PDCluster`` (a mixin: its state lives there)."""

    config: ClusterConfig
    prefill_router: PrefixRouter
    index: IndexClient | None
    mirror: IndexMirror | None
    routed = collections.Counter[str]()   # by "index" / "hints" (replaced per cluster)

    async def _ask_index(self, names: Sequence[bytes], *pinned: int | None) -> Asked:
        """The index's answer for ``names``: from this front's mirror if in sync, else
        asked; not asked when every choice is ``pinned``."""
        if self.index is None or not names or all(p is not None for p in pinned):
            return Asked(None)
        if self.mirror is not None and (found := self.mirror.answer(names)) is not None:
            return Asked(found)
        return Asked(await self.index.lookup(names))

    async def _route_prefill(self, names: Sequence[bytes], failed: Sequence[int] = (),
                             asked: Asked | None = None) -> IndexRoute:
        """By the index if it answers (``asked``: its answer, else asked here), else by
        this front's hints."""
        live = self.prefill_router.live(failed)
        found = (asked if asked is not None else await self._ask_index(names, None)).answer
        if found is None:
            self.routed["hints"] += 1
            route = self.prefill_router.pick(names, failed)
            return IndexRoute(route.worker, route.matched_pages, None)
        self.routed["index"] += 1
        # NOTE: the index learns a prefill's pages once it ran and flushed; what this front
        # routed since (a tenant's burst on one system prompt) only its hints know.
        router = self.prefill_router
        hinted = [router.matched(k, names) for k in range(len(router.loads))]
        route = pick(found, "prefill", len(names), router.loads, live,
                     RouteWeights.of(self.config), hinted, names[0])
        return IndexRoute(route.worker, route.matched_pages, found.l3_pages)
