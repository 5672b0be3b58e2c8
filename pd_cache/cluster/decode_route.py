"""Where a request decodes, and what decode already holds of its prompt.

Without a decode cache a request goes, once prefilled, to the least loaded decode worker
(or the fullest batch with room, ``decode_pack``). With one (``decode_cache``, the default)
the router also remembers the pages each decode worker kept (the prompt and answer of each
request it served), and before prefill::

    names of the prompt   -> decode_router.pick: the longest known prefix on a live worker
                             not busier than the least loaded by more than a decode batch
                             (``decode_balance``)
    matched > 0 (or pinned) -> worker.reserve(req): k pages locked there for the handoff
    prefill(req, k)       -> hands over only the pages after k
    decode on that worker -> joins its k pages with the received ones (seam checked)

The router's view is a hint: ``reserve`` answers what the worker really holds (0 after a
restart: a cold worker, a full handoff). A reservation whose request fails before its
handoff is released (or times out on the worker).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from pd_cache.cluster.calls import abandon
from pd_cache.cluster.health import Liveness, WorkerDied
from pd_cache.cluster.router import NoLiveWorker, PrefixRouter
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.config import PDCacheConfig
from pd_cache.core.request import Req, compute_prefix_hash

log = logging.getLogger(__name__)


class Reserved(NamedTuple):
    """The decode worker chosen before prefill (``None``: choose after it, by load) and the
    prompt pages it reserved for the handoff."""

    worker: int | None
    kept: int


NOTHING = Reserved(None, 0)


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
    liveness: dict[str, Liveness]

    async def _call(self, role: str, worker: int, ref: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def _check_worker(field: str, worker: Any, actors: list[Any]) -> None:
        raise NotImplementedError

    async def _reserve(self, req: Req, names: Sequence[bytes], pinned: int | None,
                       failed: Sequence[int] = ()) -> Reserved:
        """With a decode cache: the worker holding the longest prefix of ``names`` (or
        ``pinned``) and the pages it reserved; else nothing chosen yet."""
        if not self.pd.cache.decode_cache:
            return NOTHING if pinned is None else Reserved(pinned, 0)
        worker = pinned
        if worker is None:
            self.liveness["decode"].refresh()
            try:
                route = self.decode_router.pick(names, failed)
            except NoLiveWorker:
                return NOTHING
            if not route.matched_pages:
                return NOTHING
            worker = route.worker
        self._check_worker("decode_worker", worker, self.decode)
        try:
            kept = await self._call("decode", worker, self.decode[worker].reserve.remote(req))
        except WorkerDied:
            return Reserved(pinned, 0)   # marked down: another worker, a full handoff
        return Reserved(worker, kept)

    def _release(self, reserved: Reserved, rid: str) -> None:
        """The request will not reach its reserved worker: unlock the pages there."""
        if reserved.kept and reserved.worker is not None:
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
        """The decode worker for a request: ``pinned``, else the fullest batch with room
        (``decode_pack``) or the least loaded, among live workers not in ``failed``. With a
        decode cache the router learns at once that it will hold the prompt's pages
        ``names``: a request of the same prefix arriving meanwhile is routed by them."""
        self.liveness["decode"].refresh()
        if pinned is not None:
            worker = pinned
        elif self.config.decode_pack and self.config.decode_batch > 1:
            worker = self.decode_router.pack(self.config.decode_batch, failed)
        else:
            worker = self.decode_router.least_loaded(failed)
        self._check_worker("decode_worker", worker, self.decode)
        if self.pd.cache.decode_cache:
            self.decode_router.record(worker, names)
        return worker
