"""``PDCluster``: prefill, decode and storage actors on one Ray cluster, and the router.

One request::

    generate_async(req)   admit (ValueError for a bad request), name its prompt pages
      -> prefill[p]       p = longest known prefix match in req's namespace, by load
         (info_ref, pages_ref)   await info: TTFT; pages stay in the object store
      -> decode[d]        d = least loaded; fetches pages_ref itself, generates (steps
                          batched with its other requests in flight), offloads
      -> Completion       tokens, cached tokens by tier, pages moved, cross-namespace hits

The router runs on one asyncio loop (no locks): ``generate`` and ``generate_many`` are
sync fronts over ``generate_async``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pd_cache.cluster.router import PrefixRouter, Provenance, ProvenanceLedger
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.vocab import TIERS
from pd_cache.core.wire import Completion, DecodeInfo, PageNames, PrefillInfo, WorkerState


class PDCluster:
    """N prefill, M decode and S storage actors and the router; see the module docstring."""

    def __init__(self, config: ClusterConfig, prefill: Sequence[Any], decode: Sequence[Any],
                 storage: Sequence[Any]) -> None:
        self.config, self.pd = config, config.pd_config
        self.prefill, self.decode, self.storage = list(prefill), list(decode), list(storage)
        capacity = self.pd.cache.device_pages + self.pd.cache.host_pages
        self.prefill_router = PrefixRouter(len(self.prefill), capacity, config.balance_threshold)
        self.decode_router = PrefixRouter(len(self.decode), 0)
        self.ledger = ProvenanceLedger()

    @classmethod
    def start(cls, config: ClusterConfig) -> PDCluster:
        """Create the actors (``ray.init()`` first if this process has not) and wait for them."""
        import ray

        from pd_cache.storage.tier import storage_actors
        from pd_cache.worker.actors import decode_actor, prefill_actor

        if not isinstance(config, ClusterConfig):
            raise ValueError(f"config: expected ClusterConfig, got {type(config).__name__}")
        if not ray.is_initialized():
            ray.init()
        pd = config.pd_config
        storage = (storage_actors(pd, max_restarts=config.storage_restarts)
                   if config.with_storage else [])
        opts = {"threads": config.threads, "num_cpus": config.actor_cpus,
                "storage_timeout_s": config.storage_timeout_s}
        prefill = [prefill_actor(pd, i, storage, **opts) for i in range(config.num_prefill)]
        decode = [decode_actor(pd, i, storage, max_batch=config.decode_batch,
                               **opts)
                  for i in range(config.num_decode)]
        ray.get([a.ready.remote() for a in prefill + decode] + [s.ping.remote() for s in storage])
        return cls(config, prefill, decode, storage)

    # -- requests -----------------------------------------------------------------------

    def admit(self, req: Req | Mapping[str, Any]) -> Req:
        """The request checked against the model; ``ValueError`` naming the field if bad.

        Accepts a ``Req`` or its fields as a mapping (as read off the wire).
        """
        if isinstance(req, Mapping):
            req = Req(**req)
        elif not isinstance(req, Req):
            raise ValueError(f"req: expected a Req or a mapping of its fields, got "
                             f"{type(req).__name__}")
        req.check_model(vocab_size=self.pd.model.vocab_size,
                        max_context=self.pd.model.max_context)
        return req

    async def generate_async(self, req: Req | Mapping[str, Any], *,
                             prefill_worker: int | None = None,
                             decode_worker: int | None = None) -> Completion:
        """Serve one request; ``prefill_worker`` / ``decode_worker`` pin the route."""
        req = self.admit(req)
        start = time.perf_counter()
        info, pages_ref, seen = await self._prefill(req, prefill_worker)
        ttft = time.perf_counter() - start
        out = await self._decode(req, info, pages_ref, decode_worker)
        req.output_ids = list(out.output_ids)
        self.ledger.add(req.namespace, out.page_names)
        return self._complete(req, info, out, seen, ttft, time.perf_counter() - start)

    def generate(self, req: Req | Mapping[str, Any], **route: int | None) -> Completion:
        return asyncio.run(self.generate_async(req, **route))

    def generate_many(self, reqs: Iterable[Req | Mapping[str, Any]], *,
                      return_exceptions: bool = False) -> list[Any]:
        """All requests in flight at once; results in order. With ``return_exceptions``,
        a bad request's ``ValueError`` takes its place instead of being raised."""
        async def run() -> list[Any]:
            return await asyncio.gather(*(self.generate_async(r) for r in reqs),
                                        return_exceptions=return_exceptions)
        return asyncio.run(run())

    async def _prefill(self, req: Req,
                       pinned: int | None) -> tuple[PrefillInfo, Any, Provenance]:
        """Route, run prefill, and check where its cached pages came from.

        The ledger learns the prompt's names as soon as prefill returns (not when decode
        ends): a request routed by them may finish before this one does.
        """
        names = self.router_names(req)
        worker = self.prefill_router.pick(names).worker if pinned is None else pinned
        self._check_worker("prefill_worker", worker, self.prefill)
        self.prefill_router.begin(worker)
        # NOTE: the worker runs its calls in order, so once this one is queued, the next
        # request with the same prefix finds these pages there: route it by them already
        # (two clients of a tenant arriving together share the system prompt's compute).
        self.prefill_router.record(worker, names)
        try:
            info_ref, pages_ref = self.prefill[worker].prefill.remote(req)
            info = await _unwrap(info_ref)
        finally:
            self.prefill_router.end(worker)
        self.prefill_router.record(worker, info.page_names)
        seen = self.ledger.check(req.namespace, info.page_names[:info.cached_pages])
        self.ledger.add(req.namespace, info.page_names)
        return info, pages_ref, seen

    async def _decode(self, req: Req, info: PrefillInfo, pages_ref: Any,
                      pinned: int | None) -> DecodeInfo:
        if pinned is not None:
            worker = pinned
        elif self.config.decode_pack and self.config.decode_batch > 1:
            worker = self.decode_router.pack(self.config.decode_batch)
        else:
            worker = self.decode_router.least_loaded()
        self._check_worker("decode_worker", worker, self.decode)
        self.decode_router.begin(worker)
        try:
            return await _unwrap(self.decode[worker].decode.remote(req, info, [pages_ref]))
        finally:
            self.decode_router.end(worker)

    def _complete(self, req: Req, info: PrefillInfo, out: DecodeInfo, seen: Provenance,
                  ttft: float, latency: float) -> Completion:
        ps = info.page_size
        return Completion(req.rid, list(out.output_ids), info.num_prompt_tokens,
                          dict(info.cached_tokens), info.worker,
                          out.worker, ttft, latency, out.pages_received,
                          (seen.foreign_pages + info.foreign_pages) * ps,
                          seen.unattributed_pages * ps, info.compute_s, out.handoff_s,
                          out.decode_s)

    @staticmethod
    def _check_worker(field: str, worker: Any, actors: list[Any]) -> None:
        if isinstance(worker, bool) or not isinstance(worker, int) \
                or not 0 <= worker < len(actors):
            raise ValueError(f"{field}: expected an int in [0, {len(actors)}), got {worker!r}")

    # -- for tests and operators ---------------------------------------------------------

    def router_names(self, req: Req) -> list[bytes]:
        return compute_prefix_hash(req, req.input_ids, page_size=self.pd.cache.page_size,
                                   algo=self.pd.cache.hash_algo)

    def page_names(self, req: Req) -> PageNames:
        """The request's prompt page names from the router, every worker and every shard."""
        import ray

        prefill = [a.page_names.remote(req) for a in self.prefill]
        decode = [a.page_names.remote(req) for a in self.decode]
        tiers = [s.page_names.remote(req) for s in self.storage]
        return PageNames(self.router_names(req), ray.get(prefill), ray.get(decode),
                         ray.get(tiers))

    def storage_client(self, timeout_s: float | None = None) -> Any:
        """A client over this cluster's tier actors (``None`` without L3)."""
        from pd_cache.storage.client import StorageClient

        if not self.storage:
            return None
        return StorageClient(self.storage, algo=self.pd.cache.hash_algo,
                             timeout_s=timeout_s or self.config.storage_timeout_s)

    def flush(self) -> None:
        """Wait until every worker's background L3 writes so far have finished."""
        import ray

        ray.get([a.flush.remote() for a in self.prefill + self.decode])

    def l3_writes(self) -> dict[str, int]:
        """Pages stored in L3 so far (after ``flush``): ``backup`` by prefill write-through,
        ``offload`` by decode."""
        import ray

        out = {"backup": 0, "offload": 0}
        for writes in ray.get([a.l3_writes.remote() for a in self.prefill + self.decode]):
            for kind, n in writes.items():
                out[kind] += n
        return out

    def states(self) -> list[WorkerState]:
        import ray

        return ray.get([a.state.remote() for a in self.prefill + self.decode])

    def engine_stats(self) -> dict[str, dict[str, int]]:
        import ray

        stats = ray.get([a.engine_stats.remote() for a in self.prefill + self.decode])
        roles = [f"prefill-{i}" for i in range(len(self.prefill))] + \
                [f"decode-{i}" for i in range(len(self.decode))]
        return dict(zip(roles, stats))

    def shutdown(self, *, check: bool = True) -> None:
        """Close every worker (with ``check``, raise ``SlotError`` if one leaked a lock or a
        slot) and kill every actor of this cluster."""
        import ray

        closing = [a.close.remote() for a in self.prefill + self.decode] if check else []
        try:
            ray.get(closing)
        finally:
            for actor in self.prefill + self.decode + self.storage:
                ray.kill(actor)
            self.prefill, self.decode, self.storage = [], [], []


async def _unwrap(ref: Any) -> Any:
    """Await a Ray call; a ``ValueError`` raised in the actor comes back as itself."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ValueError):
            raise ValueError(str(exc.cause)) from None
        raise


def totals(completions: Iterable[Completion]) -> dict[str, Any]:
    """Sums over completions: cached tokens by tier, pages handed off, cross-namespace."""
    out: dict[str, Any] = {"requests": 0, "prompt_tokens": 0,
                           "cached_tokens": dict.fromkeys(TIERS, 0),
                           "pages_handed_off": 0, "cross_namespace_tokens": 0,
                           "unattributed_tokens": 0}
    for c in completions:
        out["requests"] += 1
        out["prompt_tokens"] += c.num_prompt_tokens
        for tier, n in c.cached_tokens.items():
            out["cached_tokens"][tier] = out["cached_tokens"].get(tier, 0) + n
        out["pages_handed_off"] += c.pages_handed_off
        out["cross_namespace_tokens"] += c.cross_namespace_tokens
        out["unattributed_tokens"] += c.unattributed_tokens
    return out


__all__ = ["ClusterConfig", "Completion", "PDCluster", "PageNames", "totals"]
