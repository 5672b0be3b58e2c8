"""``PDCluster``: prefill, decode and storage actors on one Ray cluster, and the router.

One request::

    generate_async(req)   admit (ValueError for a bad request), name its prompt pages
                          (once: a retry is routed by the same names)
      -> its turn         prefill_queue_depth calls per prefill worker out at once; the
                          rest wait here, tenants in turn (turns.py)
      -> decode[d].reserve  with a decode cache: d = the worker holding the longest
                          prefix, k = its pages locked for the handoff (decode_route.py);
                          not awaited here: prefill takes k once it has computed
      -> prefill[p]       p = longest known prefix match in req's namespace, by load
         (info, pages, states) streamed: info (the first token) back first: TTFT; pages
                          after k (and a hybrid prompt's states) stay in the object store
      -> decode[d]        d as reserved, else the least loaded; fetches them itself,
                          generates (steps batched with its other requests in flight),
                          offloads, keeps its pages (decode cache)
      -> Completion       tokens, cached tokens by tier, pages moved, cross-namespace hits

The router runs on one asyncio loop (no locks): ``generate`` and ``generate_many`` are
sync fronts over ``generate_async``.

Faults: a worker whose process died is routed around until it answers again (its actor
restarts, ``worker_restarts``), and the request it held runs once more on another worker
(prefill is pure; the retry starts again from prefill, whose cache now likely holds the
prompt). A request past its ``deadline`` is dropped wherever it waits. A cluster started
with a ``name`` is made of named, detached actors: a second ``start`` with that name, from
any process (a restarted Serve replica), attaches to them instead of starting more.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from pd_cache.cluster.calls import Streamed, abandon, first_item, handoff_refs, unwrap
from pd_cache.cluster.decode_route import NOTHING, DecodeRouting, Reserved, decode_balance
from pd_cache.cluster.health import Liveness, WorkerDied, ping_all, worker_died
from pd_cache.cluster.index_route import Asked, IndexClient, IndexRouting, index_mirror
from pd_cache.cluster.operations import ClusterOperations
from pd_cache.cluster.router import PrefixRouter
from pd_cache.cluster.turns import Turns
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.wire import Completion, DecodeInfo, PageNames, PrefillInfo

log = logging.getLogger(__name__)


class PDCluster(IndexRouting, DecodeRouting, ClusterOperations):
    """N prefill, M decode and S storage actors and the router; see the module docstring."""

    def __init__(self, config: ClusterConfig, prefill: Sequence[Any], decode: Sequence[Any],
                 storage: Sequence[Any], index: Sequence[Any] = ()) -> None:
        self.config, self.pd = config, config.pd_config
        self.prefill, self.decode, self.storage = list(prefill), list(decode), list(storage)
        self.index_actors, self.routed = list(index), collections.Counter[str]()
        self.index = IndexClient(index, config.index_timeout_s) if index else None
        self.mirror = index_mirror(config, index)
        self._owners: dict[str, bytes] = {}
        capacity = self.pd.cache.device_pages + self.pd.cache.host_pages
        self.prefill_router = PrefixRouter(len(self.prefill), capacity, config.balance_threshold)
        self.decode_router = PrefixRouter(len(self.decode),
                                          capacity if self.pd.cache.decode_cache else 0,
                                          decode_balance(config))
        # NOTE: requests beyond the workers' short queues wait here, tenants in turn.
        self.turns = Turns(config.prefill_queue_depth * len(self.prefill))
        self.liveness = {"prefill": Liveness("prefill", self.prefill, self.prefill_router),
                         "decode": Liveness("decode", self.decode, self.decode_router)}

    @classmethod
    def start(cls, config: ClusterConfig, name: str | None = None, *,
              secret: bytes | None = None) -> PDCluster:
        """Create the actors (``ray.init()`` first if need be) and wait for them; their L3
        keys derive from ``secret`` (``pd_cache.core.sealing.cluster_keyring``).

        With ``name`` the actors are named and detached (Ray namespace ``pd-cache``): they
        outlive this process, and a later ``start`` with the same name attaches to them
        (``destroy(name)`` removes them)."""
        from pd_cache.cluster.launch import launch

        actors = launch(config, name, secret)
        cluster = cls(config, actors.prefill, actors.decode, actors.storage, actors.index)
        cluster.keys, cluster.keys_name = actors.keys.state, actors.keys.name
        return cluster

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
        """Serve one request; ``prefill_worker`` / ``decode_worker`` pin the first attempt.

        Raises ``ValueError`` for a bad request, ``DeadlineExceeded`` past its deadline,
        ``WorkerDied`` if a worker died under it twice, ``NoLiveWorker`` if a role has no
        live worker.
        """
        req = self.admit(req)
        names = self.router_names(req)
        start, failed = time.perf_counter(), {"prefill": [], "decode": []}
        for attempt in (1, 2):
            try:
                async with self.turns.turn(req.tenant):
                    asked = await self._ask_index(names, prefill_worker, decode_worker)
                    reserved = self._reserve(req, names, decode_worker, failed["decode"],
                                             asked.answer)
                    info, handoff = await self._prefill(req, names, prefill_worker,
                                                        failed["prefill"], reserved, asked=asked)
                reserved = self._settle(reserved, info, decode_worker)
                ttft = time.perf_counter() - start
                out = await self._decode(req, info, handoff, reserved.worker,
                                         failed["decode"])
                self._remember(out.worker, req, names, out.output_ids)
                break
            except WorkerDied as e:
                if attempt == 2 or req.expired():
                    raise
                log.warning("request %s: %s; running it again elsewhere", req.rid, e)
                failed[e.role].append(e.worker)
                prefill_worker = decode_worker = None
        req.output_ids = list(out.output_ids)
        return self._complete(req, info, out, ttft, time.perf_counter() - start, attempt)

    async def stream(self, req: Req | Mapping[str, Any]) -> AsyncIterator[int | Completion]:
        """Serve one request token by token: each token id as soon as it is drawn (the first
        right after prefill: its arrival is the TTFT), then the ``Completion``.

        A worker that dies under the request is replaced once. Before the first token the
        request runs again elsewhere; after it, the answer resumes on other workers from
        the tokens already sent: a prefill of prompt + those tokens draws the next one as
        the whole answer would (``SamplingParams.first_step``), so the client gets every
        token once, in order, and the answer is the one an unbroken run gives. Closing the
        iterator early (a client that went away) cancels the request's decode. Other errors
        as ``generate_async``.
        """
        req = self.admit(req)
        start, failed = time.perf_counter(), {"prefill": [], "decode": []}
        part, names, sent, attempt = req, self.router_names(req), [], 1
        first: PrefillInfo | None = None    # the prompt's own prefill: what is reported
        ttft, out = 0.0, None
        while True:
            try:
                async with self.turns.turn(req.tenant):
                    asked = await self._ask_index(names, None)
                    reserved = self._reserve(part, names, None, failed["decode"], asked.answer)
                    info, handoff = await self._prefill(part, names, None, failed["prefill"],
                                                        reserved, asked=asked)
                reserved = self._settle(reserved, info, None)
                if first is None:
                    first, ttft = info, time.perf_counter() - start
                if part.max_new_tokens:
                    sent.append(info.first_token)
                    yield info.first_token
                async for item in self._decode_stream(part, info, handoff, reserved.worker):
                    if isinstance(item, DecodeInfo):
                        out = item
                        self._remember(out.worker, part, names, out.output_ids)
                    else:
                        sent.append(item)
                        yield item
                break
            except WorkerDied as e:
                if attempt == 2 or req.expired():
                    raise
                attempt, out = 2, None
                failed[e.role].append(e.worker)
                if req.answered_by(sent):   # every token was drawn: only the summary was lost
                    break
                log.warning("request %s: %s after %d tokens; resuming elsewhere", req.rid, e,
                            len(sent))
                part = req.resumed_after(sent)
                names = self.router_names(part)
        req.output_ids = list(sent)
        whole = DecodeInfo(req.rid, -1, list(sent), 0, 0, 0.0, 0.0) if out is None else \
            msgspec.structs.replace(out, output_ids=list(sent))
        yield self._complete(req, first, whole, ttft, time.perf_counter() - start, attempt)

    async def _decode_stream(self, req: Req, info: PrefillInfo, streamed: Streamed,
                             pinned: int | None) -> AsyncIterator[int | DecodeInfo]:
        handoff = await self._handoff(req, streamed, pinned)
        worker = self._pick_decode(pinned, (), info.page_names)
        self.decode_router.begin(worker)
        actor, finished, calls = self.decode[worker], False, None
        try:
            calls = actor.stream_handoff.remote(req, info, handoff)
            async for ref in calls:
                item = await unwrap(ref)
                finished = isinstance(item, DecodeInfo)
                yield item
        except Exception as e:
            if worker_died(e):
                raise self.liveness["decode"].died(worker, e) from e
            raise
        finally:
            self.decode_router.end(worker)
            if not finished:   # the consumer stopped early or the call failed: stop decoding
                self._stop_decode(worker, req.rid, calls)

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

    def router_names(self, req: Req) -> list[bytes]:
        """The prompt's page names in this process: what requests are routed by (computed
        once per request)."""
        return compute_prefix_hash(req, req.input_ids, page_size=self.pd.cache.page_size,
                                   algo=self.pd.cache.hash_algo)

    async def _prefill(self, req: Req, names: list[bytes], pinned: int | None,
                       failed: Sequence[int] = (), reserved: Reserved = NOTHING,
                       l3_pages: int | None = None,
                       asked: Asked | None = None) -> tuple[PrefillInfo, Any]:
        """Route and run prefill by ``names`` (the prompt's, ``router_names``); the router
        learns the pages the worker now holds. The KV handed over starts after the pages
        ``reserved`` on decode; if prefill fails, that reservation is released.
        ``l3_pages``: the leading pages of ``names`` L3 holds (the worker reads them with
        no ``exists``); ``None``: what the page index answers when it routes (``asked``:
        its answer for this attempt, else asked here), else none."""
        self.liveness["prefill"].refresh()
        call = None
        try:
            route = await self._route_prefill(names, failed, asked) if pinned is None \
                else None
            worker = pinned if route is None else route.worker
            self._check_worker("prefill_worker", worker, self.prefill)
            self.prefill_router.begin(worker)
        except BaseException:
            self._release(reserved, req.rid)
            raise
        # NOTE: the worker runs its calls in order, so once this one is queued, the next
        # request with the same prefix finds these pages there: route it by them already
        # (two clients of a tenant arriving together share the system prompt's compute).
        self.prefill_router.record(worker, names)
        try:
            if l3_pages is None and route is not None:
                l3_pages = route.l3_pages   # the index's answer (None: it did not answer)
            # NOTE: streamed: the answer (the first token) comes back before the worker
            # stores the KV for decode, writes L3 and records metrics (``_handoff``).
            call = self.prefill[worker].prefill_stream.remote(req, reserved.kept_arg, l3_pages)
            info = await self._call("prefill", worker, first_item(call))
        except BaseException as e:
            self._release(reserved, req.rid)   # decode will not see this request
            if isinstance(e, asyncio.CancelledError) and call is not None:
                abandon(call)   # its caller went away: a prefill still queued never runs
            raise
        finally:
            self.prefill_router.end(worker)
        self.prefill_router.record(worker, info.page_names)
        return info, Streamed(worker, call)

    async def _handoff(self, req: Req, streamed: Streamed, pinned: int | None) -> list[Any]:
        """``[pages_ref, states_ref]`` of a streamed prefill, for decode to fetch; if the
        prefill worker died after answering, ``WorkerDied`` (prefill's) and the decode
        reservation (on ``pinned``) released."""
        try:
            return await self._call("prefill", streamed.worker, handoff_refs(streamed))
        except BaseException:
            if pinned is not None:
                self.decode[pinned].release.remote(req.rid)
            raise

    async def _decode(self, req: Req, info: PrefillInfo, streamed: Streamed,
                      pinned: int | None, failed: Sequence[int] = ()) -> DecodeInfo:
        handoff = await self._handoff(req, streamed, pinned)
        worker = self._pick_decode(pinned, failed, info.page_names)
        self.decode_router.begin(worker)
        try:
            ref = self.decode[worker].decode_handoff.remote(req, info, handoff)
            return await self._call("decode", worker, ref)
        except asyncio.CancelledError:
            self._stop_decode(worker, req.rid, ref)
            raise
        finally:
            self.decode_router.end(worker)

    async def _call(self, role: str, worker: int, ref: Any) -> Any:
        """Await a worker's call (a ref, or a coroutine awaiting one): its own errors come
        back as themselves, a dead worker (or lost pages) as ``WorkerDied`` after the worker
        is marked down."""
        try:
            return await unwrap(ref)
        except Exception as e:
            if worker_died(e):
                raise self.liveness[role].died(worker, e) from e
            raise

    async def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ping every actor: the live ones by role; ``healthy`` once prefill and decode each
        have a live worker (a dead L3 shard costs only misses)."""
        live = {role: await lv.check(timeout_s) for role, lv in self.liveness.items()}
        answers = await ping_all([s.ping.remote() for s in self.storage], timeout_s)
        live["storage"] = [i for i, a in enumerate(answers) if not isinstance(a, BaseException)]
        return {"healthy": bool(live["prefill"]) and bool(live["decode"]), "live": live,
                "workers": {"prefill": len(self.prefill), "decode": len(self.decode),
                            "storage": len(self.storage)}}

    def _complete(self, req: Req, info: PrefillInfo, out: DecodeInfo, ttft: float,
                  latency: float, attempts: int = 1) -> Completion:
        ps = info.page_size
        return Completion(req.rid, list(out.output_ids), info.num_prompt_tokens,
                          dict(info.cached_tokens), info.worker,
                          out.worker, ttft, latency, out.pages_received,
                          (info.cross_namespace_pages + out.cross_namespace_pages) * ps,
                          attempts, info.compute_s, out.handoff_s,
                          out.decode_s, out.pages_kept)

    @staticmethod
    def _check_worker(field: str, worker: Any, actors: list[Any]) -> None:
        if isinstance(worker, bool) or not isinstance(worker, int) \
                or not 0 <= worker < len(actors):
            raise ValueError(f"{field}: expected an int in [0, {len(actors)}), got {worker!r}")


__all__ = ["ClusterConfig", "Completion", "PDCluster", "PageNames"]
