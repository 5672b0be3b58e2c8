"""Where a request decodes, and what decode already holds of its prompt.

Without a decode cache a request goes, once prefilled, to the least loaded decode worker
(or the fullest batch with room, ``decode_pack``): ``_by_load``. With one
(``decode_cache``, the default) the router also remembers the pages each decode worker
kept (the prompt and answer of each request it served), and before prefill::

    names of the prompt   -> decode_router.pick: the longest known prefix on a live worker
                             not busier than the least loaded by more than a decode batch
                             (``decode_balance``)
    matched > 0 (or pinned) -> worker.reserve(req), not awaited: it runs while prefill
                             computes, k pages locked there for the handoff
    prefill(req, [reserve]) -> computes the prompt, then takes k from the reserve call
                             (0 if it failed) and hands over only the pages after k
    decode on that worker -> joins its k pages with the received ones (seam checked)
    matched == 0          -> placed now by load, the worker told to expect the handoff:
                             a client of the same tenant arriving meanwhile reserves the
                             system prompt there (decode_cache.py's ``expect``, ``hold``)

Packing (``decode_pack``) and the prefix each decode worker keeps both gather requests on
one decode worker; on workers that share a few cores that leaves cores idle whenever the
prefills are done and one decode batch steps alone (a closed loop's clients all waiting on
their answers, a run's last batches). ``spread``: while fewer workers (prefill and decode)
have requests in flight than the cores they share (``decode_spread_cores``), a request
whose chosen decode worker is busy goes to an idle one instead; the conversation's next
turns follow it there (its cache now holds them). Busy cores keep the packing and the
affinity. Off by default: on shared CPU cores two half batches cost more CPU than the idle
core gives back (docs/benchmarks.md).

The reservation costs the time to first token nothing but the call's submission: measured
before it was folded into prefill, awaiting it took 8 ms at the median and 26 ms at p90
under bench_decode_cache's load (about 2% and 7% of TTFT p50).

The router's view is a hint: ``reserve`` answers what the worker really holds (0 after a
restart: a cold worker, a full handoff). A reservation whose request fails before its
handoff, or that prefill did not use, is released (or times out on the worker).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from pd_cache.cluster.calls import abandon
from pd_cache.cluster.health import Liveness
from pd_cache.cluster.index_route import held_by
from pd_cache.cluster.router import NoLiveWorker, PrefixRouter
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.config import PDCacheConfig
from pd_cache.core.events import IndexAnswer
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.wire import PrefillInfo

log = logging.getLogger(__name__)


class Reserved(NamedTuple):
    """The decode worker chosen before prefill (``None``: choose after it, by load), its
    ``reserve`` call under way (``None``: none made), which prefill awaits, whether the
    worker was told to expect the handoff (a request placed before its prefill), and whether
    the request counts in the worker's load from now (placed, or spread there)."""

    worker: int | None
    call: Any = None
    announced: bool = False
    counted: bool = False

    @property
    def kept_arg(self) -> int | list[Any]:
        """``prefill``'s ``kept_pages``: the call nested in a list (Ray passes it on
        unresolved), or 0."""
        return 0 if self.call is None else [self.call]


NOTHING = Reserved(None)


def spread(choice: int, decode_loads: Sequence[int], prefill_loads: Sequence[int],
           cores: int, live: Sequence[int]) -> int:
    """``choice``, or the lowest idle decode worker of ``live`` if ``choice`` has requests
    in flight while fewer workers than ``cores`` do (a core would sit idle beside its
    batch)::

        cores 2   prefill loads 0 0   decode loads 5 0   choice 0 -> 1 (one busy worker)
                  prefill loads 1 0   decode loads 5 0   choice 0 -> 0 (two: cores busy)
    """
    busy = sum(1 for n in (*prefill_loads, *decode_loads) if n)
    if not decode_loads[choice] or busy >= cores:
        return choice
    return next((w for w in live if not decode_loads[w]), choice)


def decode_balance(config: ClusterConfig) -> int:
    """How much busier than the least loaded decode worker the one holding a prefix may be
    and still get the request: a decode batch joins a request in flight at little cost, so
    up to a batch (``decode_batch - 1``), or ``balance_threshold`` if larger (or with
    batches of one)."""
    return max(config.balance_threshold, config.decode_batch - 1)


class DecodeRouting:
    """The decode side of ``PDCluster``'s routing (a mixin: its state lives there)."""

    config: ClusterConfig
    pd: PDCacheConfig
    decode: list[Any]
    decode_router: PrefixRouter
    prefill_router: PrefixRouter
    liveness: dict[str, Liveness]

    @staticmethod
    def _check_worker(field: str, worker: Any, actors: list[Any]) -> None:
        raise NotImplementedError

    def _reserve(self, req: Req, names: Sequence[bytes], pinned: int | None,
                 failed: Sequence[int] = (), found: IndexAnswer | None = None) -> Reserved:
        """With a decode cache: the worker holding the longest prefix of ``names`` (or
        ``pinned``) and its reservation, asked for, not awaited; a request no worker holds
        a prefix of is placed now (``_place``). Without: nothing chosen yet. What a worker
        holds is the longer of this front's hints and the page index's answer ``found``
        (what each decode worker published of its cache: what other fronts routed there)."""
        if not self.pd.cache.decode_cache:
            return Reserved(pinned)
        worker = pinned
        if worker is None:
            self.liveness["decode"].refresh()
            try:
                route = self.decode_router.pick(names, failed,
                                                held_by(found, "decode", len(self.decode)))
            except NoLiveWorker:
                return NOTHING
            if not route.matched_pages:
                return self._place(req, names, failed)
            worker = self._spread(route.worker, failed)
            if worker != route.worker:
                return self._spread_to(worker, req, names)
        self._check_worker("decode_worker", worker, self.decode)
        return Reserved(worker, self.decode[worker].reserve.remote(req))

    def _spread_to(self, worker: int, req: Req, names: Sequence[bytes]) -> Reserved:
        """Reserve on the idle ``worker`` (``spread``), counted in its load from now so that
        the next request sees it busy: a reservation if it knows a prefix, else placed."""
        if not self.decode_router.matched(worker, names):
            return self._place(req, names, (), worker)
        self.decode_router.begin(worker)
        return Reserved(worker, self.decode[worker].reserve.remote(req), counted=True)

    def _place(self, req: Req, names: Sequence[bytes], failed: Sequence[int],
               worker: int | None = None) -> Reserved:
        """Place a request before its prefill, by load: the router learns at once that the
        worker will hold ``names``, and the worker expects the handoff, so that a request
        of the same prefix arriving meanwhile (another client of the tenant) reserves the
        shared pages there, waiting for them to arrive if need be. ``worker``: this one,
        not the one by load."""
        worker = self._by_load(failed) if worker is None else worker
        self.decode_router.record(worker, names)
        # NOTE: counted in the worker's load from now to its decode call (``_unplace``):
        # the next requests of a burst are placed by it too, not all on one worker.
        self.decode_router.begin(worker)
        self.decode[worker].expect.remote(req.rid, list(names))
        return Reserved(worker, announced=True, counted=True)

    def _unplace(self, reserved: Reserved) -> None:
        """A placed request leaves its prefill: its load counts from its decode call on."""
        if reserved.counted and reserved.worker is not None:
            self.decode_router.end(reserved.worker)

    def _settle(self, reserved: Reserved, info: PrefillInfo, pinned: int | None) -> Reserved:
        """After prefill: a reservation it did not use (the worker held nothing, or its
        call failed or came too late) is released, and the decode worker is chosen anew
        (``_pick_decode``) unless ``pinned``."""
        self._unplace(reserved)
        if reserved.call is None or info.kept_pages:
            return reserved
        self._unlock(reserved, info.rid)
        return Reserved(pinned)

    def _release(self, reserved: Reserved, rid: str) -> None:
        """The request will not use its reservation (its prefill failed): unlock the pages
        there."""
        self._unplace(reserved)
        self._unlock(reserved, rid)

    def _unlock(self, reserved: Reserved, rid: str) -> None:
        if reserved.worker is not None and (reserved.call is not None or reserved.announced):
            self.decode[reserved.worker].release.remote(rid)

    def _remember(self, worker: int, req: Req, names: Sequence[bytes],
                  output_ids: Sequence[int]) -> None:
        """``worker`` now holds the full pages of prompt + answer (decode computed the KV
        of every token but the last one drawn)."""
        if not self.pd.cache.decode_cache:
            return
        ps = self.pd.cache.page_size
        seq = [*req.input_ids, *output_ids[:-1]]
        more = compute_prefix_hash(req, seq[len(names) * ps:], names[-1] if names else None,
                                   page_size=ps, algo=self.pd.cache.hash_algo)
        self.decode_router.record(worker, [*names, *more])

    def _stop_decode(self, worker: int, rid: str, ref: Any) -> None:
        """Its caller went away: a decode call still queued never runs, one in the batch
        leaves it at the worker's next step."""
        abandon(ref)
        self.decode[worker].cancel.remote(rid)

    def _pick_decode(self, pinned: int | None, failed: Sequence[int] = (),
                     names: Sequence[bytes] = ()) -> int:
        """The decode worker for a request: ``pinned``, else (with a decode cache) the one
        known to hold the longest prefix of the prompt's pages ``names`` if not overloaded
        (``decode_balance``), else by load, among live workers not in ``failed``. With a
        decode cache the router learns at once that it will hold ``names``."""
        self.liveness["decode"].refresh()
        worker = pinned
        if worker is None and self.pd.cache.decode_cache and names:
            route = self.decode_router.pick(names, failed)
            worker = self._spread(route.worker, failed) if route.matched_pages else None
        if worker is None:
            worker = self._by_load(failed)
        self._check_worker("decode_worker", worker, self.decode)
        if self.pd.cache.decode_cache:
            self.decode_router.record(worker, names)
        return worker

    def _by_load(self, failed: Sequence[int]) -> int:
        """The fullest batch with room (``decode_pack``; ``spread`` while cores idle) or
        the least loaded worker."""
        if self.config.decode_pack and self.config.decode_batch > 1:
            return self._spread(self.decode_router.pack(self.config.decode_batch, failed),
                                failed)
        return self.decode_router.least_loaded(failed)

    def _spread(self, choice: int, failed: Sequence[int]) -> int:
        """``spread`` over this front's loads and the cores the workers share."""
        cores = self.spread_cores
        if not cores:
            return choice
        return spread(choice, self.decode_router.loads, self.prefill_router.loads, cores,
                      self.decode_router.live(failed))

    @functools.cached_property
    def spread_cores(self) -> int:
        """``decode_spread_cores``, or (-1) the CPUs of the Ray cluster (this machine's
        without Ray)."""
        if self.config.decode_spread_cores >= 0:
            return self.config.decode_spread_cores
        import ray

        if ray.is_initialized():
            return int(ray.cluster_resources().get("CPU", 0)) or 1
        return os.cpu_count() or 1
