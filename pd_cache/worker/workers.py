"""Prefill and decode workers: plain classes around one ``LocalEngine`` each.

They import and run without Ray (``pd_cache.worker.actors`` hosts them in actors). What crosses
between them is typed: ``PrefillInfo`` (small, msgspec) travels next to the prompt's KV
pages (one tensor, handed over as an ObjectRef), and ``DecodeInfo`` comes back::

    PrefillWorker.prefill(req)  -> PrefillResult(info: PrefillInfo, kv_pages, states)
    PrefillWorker.prefill_first(req) -> Answered(PrefillResult, after): the L3 write and
                                the metrics left for after the answer
    DecodeWorker.decode(req, info, kv_pages, handoff_s, states) -> DecodeInfo

(``states``: a hybrid prompt's recurrent state, ``PromptState.pack``; ``None`` when plain.)

Every reader audits the namespace without trusting the lookup: the prefill engine compares
the producer's namespace seed stored with each cached page (radix node, L3 record) with its
request's own, and the decode worker compares the handed-off KV's seed (``PrefillInfo.seed``)
with its request's; a page that fails is refused, recomputed and counted
(``cross_namespace_pages``). Handed-off KV that passes keeps the names prefill computed for
it (``PrefillInfo.page_names``): decode's offload writes the prompt's pages under them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.vocab import TIERS, Event, MissReason, namespace_kind
from pd_cache.core.wire import DecodeInfo, PrefillInfo, WorkerState
from pd_cache.kv.pinning import PinnedPage
from pd_cache.metrics import PDCacheMetrics
from pd_cache.worker.batching import DecodeBatcher
from pd_cache.worker.decode_cache import DecodeCache, Joined
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.outputs import (
    Answered,
    PrefillResult,
    PromptState,
    answered_kept,
    pages_in,
)

log = logging.getLogger(__name__)


class _Worker:
    role = ""

    def __init__(self, config: PDCacheConfig, *, worker_id: int = 0, storage: Any = None,
                 metrics: PDCacheMetrics | None = None, storage_timeout_s: float = 30.0) -> None:
        if not isinstance(config, PDCacheConfig):
            raise ValueError(f"config: expected PDCacheConfig, got {type(config).__name__}")
        self.config, self.worker_id, self.metrics = config, worker_id, metrics
        self.page_size = config.cache.page_size
        self.engine = LocalEngine(config, storage=storage, storage_timeout_s=storage_timeout_s,
                                  metrics=metrics)

    def page_names(self, req: Req) -> list[bytes]:
        """The request's prompt page names as this process computes them (debug)."""
        return compute_prefix_hash(req, req.input_ids, page_size=self.page_size,
                                   algo=self.config.cache.hash_algo)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for this worker's background L3 writes (write-through, offload)."""
        return self.engine.flush(timeout)

    def l3_writes(self) -> dict[str, int]:
        """Pages this worker stored in L3 so far: ``backup`` (prefill write-through) and
        ``offload`` (decode), as acknowledged by the tier."""
        stats = self.engine.stats
        return {"backup": stats.get("backup", "page"), "offload": stats.get("offload", "page")}

    def drop_cache(self) -> dict[str, int]:
        """Empty this worker's L1 and L2 (``LocalEngine.drop_cache``)."""
        dropped = self.engine.drop_cache()
        self._set_pools()
        return dropped

    def drop_namespaces(self, seeds: Collection[bytes]) -> int:
        """Drop this worker's L1 and L2 pages of the namespaces ``seeds`` (a purged
        tenant's) once pending L3 writes are done; how many pages went."""
        self.engine.flush()
        dropped = self.engine.cache.drop_where(lambda node: node.seed in seeds)
        self._set_pools()
        return dropped

    def pins(self, tenant: str) -> list[PinnedPage]:
        """``tenant``'s pinned pages here (``RadixCache.pinned``)."""
        with self._cache_held():
            return self.engine.cache.pinned(tenant)

    def drop_pins(self, tenant: str) -> int:
        """Unpin ``tenant``'s pages here (they stay cached); how many."""
        with self._cache_held():
            return self.engine.cache.drop_pins(tenant)

    def _cache_held(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def state(self) -> WorkerState:
        return WorkerState(self.worker_id, self.role, self.engine.locks_held(),
                           self.engine.pool_usage())

    def engine_stats(self) -> dict[str, int]:
        return self.engine.stats.snapshot()

    def close(self) -> None:
        """Flush, then release the cache; ``SlotError`` if a lock or slot leaked."""
        self.flush()
        self.engine.close()

    def _count_request(self, req: Req) -> None:
        if self.metrics is not None:
            self.metrics.count_request(self.role, namespace_kind(*req.namespace))

    def _set_pools(self) -> None:
        if self.metrics is None:
            return
        for tier, pool in (("device", self.engine.device_pool), ("host", self.engine.host_pool)):
            self.metrics.set_pool(tier, pool.used, pool.capacity)


class PrefillWorker(_Worker):
    """Admits a request, reuses cached pages (L1/L2, and L3 through the engine), computes
    the rest of the prompt and returns its KV pages and first token."""

    role = "prefill"

    def prefill(self, req: Req, kept_pages: int | Callable[[], int] = 0,
                l3_pages: int | None = None) -> PrefillResult:
        """``prefill_first``'s answer, what follows it done."""
        result, after = self.prefill_first(req, kept_pages, l3_pages)
        after()
        return result

    def prefill_first(self, req: Req, kept_pages: int | Callable[[], int] = 0,
                      l3_pages: int | None = None) -> Answered:
        """The ``PrefillResult``, and what may follow once it is on its way (``after``: the
        L3 write-through, then the metrics).

        Raises ``ValueError`` for a request the model cannot serve (nothing is cached),
        ``DeadlineExceeded`` for one past its deadline (nothing is computed).

        ``kept_pages``: the prompt's leading pages the decode worker holds (reserved
        there), or a function answering it, called once the prompt is computed (so the
        reservation runs meanwhile; an answer out of range hands over the whole prompt);
        the KV returned starts after them. ``l3_pages``: the prompt chain's leading pages
        L3 holds, as a page index says (read with no ``exists``; ``None``: no index)."""
        req.check_deadline("prefill")
        full = len(req.input_ids) // self.page_size
        if not callable(kept_pages) and not pages_in(kept_pages, full):
            raise ValueError(f"kept_pages: expected an int in [0, {full}], got {kept_pages!r}")
        if l3_pages is not None and (isinstance(l3_pages, bool) or not isinstance(l3_pages, int)
                                     or l3_pages < 0):
            raise ValueError(f"l3_pages: expected an int >= 0 or None, got {l3_pages!r}")
        start = time.perf_counter()
        out, backup = self.engine.prefill_first(req, l3_pages)
        seconds = time.perf_counter() - start
        if callable(kept_pages):
            kept_pages = answered_kept(kept_pages(), full, req.rid)
        cached = {tier: int(out.cached_tokens.get(tier, 0)) for tier in TIERS}
        states, state_pages = out.state.pack() if out.state is not None else (None, ())
        info = PrefillInfo(req.rid, self.worker_id, out.first_token, out.num_prompt_tokens,
                           self.page_size, tuple(out.page_names), cached, out.seed,
                           out.cross_namespace_pages, seconds, state_pages, kept_pages,
                           out.l3_pages)
        return Answered(PrefillResult(info, out.kv_pages[kept_pages:], states),
                        functools.partial(self._after, req, info, backup))

    def _after(self, req: Req, info: PrefillInfo, backup: Callable[[], None]) -> None:
        """The prompt's L3 write-through issued, the request's metrics recorded."""
        backup()
        self._record(req, info)

    def _record(self, req: Req, info: PrefillInfo) -> None:
        if self.metrics is None:
            return
        self._count_request(req)
        m, cached = self.metrics, sum(info.cached_tokens.values())
        m.count_tokens("prefill", "prompt", info.num_prompt_tokens)
        m.count_tokens("prefill", "computed", info.num_prompt_tokens - cached)
        # NOTE: the engine looks up every full page before the last prompt token (whose
        # logits give the first token, so it is always computed).
        m.count_prefix_queries((info.num_prompt_tokens - 1) // self.page_size * self.page_size)
        for tier, n in info.cached_tokens.items():
            m.count_cached_tokens(tier, n)
        m.observe_ttft(info.compute_s, role="prefill")
        self._set_pools()


class DecodeWorker(_Worker):
    """Copies the handed-off prompt pages into its own memory and generates the answer;
    the engine's offload manager writes prompt and generated pages to L3."""

    role = "decode"

    def __init__(self, config: PDCacheConfig, *, max_batch: int = 1, **kwargs: Any) -> None:
        """Concurrent ``decode`` calls share batched forward steps (``DecodeBatcher``), up to
        ``max_batch`` requests per step (1: one request at a time)."""
        super().__init__(config, **kwargs)
        self.keeper: DecodeCache | None = None
        if config.cache.decode_cache and self.engine.device_pool.capacity:
            self.keeper = DecodeCache(self.engine)
            self.engine.keeper = self.keeper.keep
        self.batcher = DecodeBatcher(self.engine, max_batch=max_batch, metrics=self.metrics)
        self._record_lock = threading.Lock()

    def reserve(self, req: Req) -> int:
        """Lock the longest prefix of ``req``'s prompt this worker's cache holds, for the
        handoff that follows; pages reserved (0 without a decode cache)."""
        return 0 if self.keeper is None else self.keeper.reserve(req)

    def release(self, rid: str) -> bool:
        """Drop a reservation whose request will not come (it went elsewhere)."""
        return self.keeper is not None and self.keeper.release(rid)

    def expect(self, rid: str, names: Sequence[bytes]) -> None:
        """Request ``rid``'s handoff (its prompt's pages ``names``) is coming: a reservation
        it would lengthen waits for it (until ``hold`` or ``release``)."""
        if self.keeper is not None:
            self.keeper.expect(rid, names)

    def hold(self, req: Req, pages: torch.Tensor | None,
             names: Sequence[bytes] | None) -> None:
        """The prompt's joined pages into the decode cache while it decodes (``None``: they
        did not arrive)."""
        if self.keeper is not None:
            self.keeper.hold(req, pages, names)

    def drop_cache(self) -> dict[str, int]:
        with self._cache_held():
            return super().drop_cache()

    def drop_namespaces(self, seeds: Collection[bytes]) -> int:
        with self._cache_held():
            return super().drop_namespaces(seeds)

    def _cache_held(self) -> AbstractContextManager[Any]:
        # NOTE: the batcher's thread inserts finished sequences into the decode cache.
        return contextlib.nullcontext() if self.keeper is None else self.keeper.lock

    def decode(self, req: Req, info: PrefillInfo, kv_pages: torch.Tensor,
               handoff_s: float = 0.0, states: torch.Tensor | None = None) -> DecodeInfo:
        """Every token at once. Raises ``ValueError`` if the pages, ``states`` (a hybrid
        prompt's) or ``info`` do not fit the request, ``DeadlineExceeded`` past its
        deadline."""
        *_, result = self.decode_stream(req, info, kv_pages, handoff_s, states)
        return result

    def decode_stream(self, req: Req, info: PrefillInfo, kv_pages: torch.Tensor,
                      handoff_s: float = 0.0,
                      states: torch.Tensor | None = None) -> Iterator[int | DecodeInfo]:
        """Each token after the first as it is drawn, then the ``DecodeInfo`` (whose
        ``output_ids`` has them all, the first included). Errors as ``decode``."""
        if info.rid != req.rid:
            raise ValueError(f"info.rid: {info.rid!r} does not match request {req.rid!r}")
        # NOTE: received pages may be read-only shared memory: decode and offload copy them.
        start = time.perf_counter()
        received, first, refused = kv_pages, info.first_token, self._audit(req, info)
        names: tuple[bytes, ...] | None = info.page_names
        kept: Joined | None = None
        arrived = None   # NOTE: what the cache may keep: nothing unless the handoff joined
        try:
            state = None if states is None else PromptState.unpack(states, info.state_pages,
                                                                   self.engine.layout)
            if refused:   # another namespace's KV, and names: this request's own are made here
                self.release(req.rid)
                kv_pages, first, state = self.engine.compute_prompt(req)
                names = None
            elif info.kept_pages:
                kept = self._join(req, info, kv_pages)
                kv_pages, names = kept.pages, names if kept.seam_ok else None
            arrived = None if refused else kv_pages
        finally:
            self.hold(req, arrived, names)
        drawn: queue.SimpleQueue[int] = queue.SimpleQueue()
        done = self.batcher.submit(req, kv_pages, info.num_prompt_tokens, first, drawn.put,
                                   state=state, names=names,
                                   l3_pages=info.l3_pages if names is not None else None)
        while not done.done() or not drawn.empty():
            try:
                yield drawn.get(timeout=0.05)
            except queue.Empty:
                continue
        tokens = done.result()
        result = DecodeInfo(req.rid, self.worker_id, tokens, int(received.shape[0]), refused,
                            handoff_s, time.perf_counter() - start, kept.kept if kept else 0)
        with self._record_lock:   # calls may run on several threads; metrics deltas may not
            self._record(req, info, result, received, kept)
        yield result

    def _join(self, req: Req, info: PrefillInfo, received: torch.Tensor) -> Joined:
        """The prompt's pages from this worker's kept ones and the ``received`` rest."""
        if self.keeper is not None:
            return self.keeper.join(req, info, received)
        # NOTE: kept pages announced to a worker with no cache: the prompt is computed here
        log.error("request %s: %d pages kept for a decode worker with no cache; "
                  "recomputing the prompt", req.rid, info.kept_pages)
        return Joined(self.engine.compute_prompt(req)[0], info.kept_pages, {})

    def cancel(self, rid: str) -> None:
        """Stop decoding request ``rid`` (its client went away)."""
        self.batcher.cancel(rid)
        self.release(rid)

    def state(self) -> WorkerState:
        if self.keeper is not None:
            self.keeper.sweep()
        return super().state()._replace(requests=self.batcher.in_flight())

    def _audit(self, req: Req, info: PrefillInfo) -> int:
        """Pages handed off for another namespace than ``req``'s (all of them, or 0)."""
        if info.seed == req.namespace_seed(self.config.cache.hash_algo):
            return 0
        log.error("request %s: the handed-off KV was computed in another namespace; "
                  "refused, recomputing the prompt", req.rid)
        self.engine.stats.count(Event.MISS, MissReason.CROSS_NAMESPACE, info.num_kv_pages)
        return info.num_kv_pages

    def close(self) -> None:
        self.batcher.close()
        if self.keeper is not None:
            self.keeper.close()
        super().close()

    def _record(self, req: Req, info: PrefillInfo, result: DecodeInfo,
                pages: torch.Tensor, kept: Joined | None) -> None:
        """Request-level figures; offloaded pages and inter-token times are recorded where
        they happen (the tiering layer, the batcher)."""
        if self.metrics is None:
            return
        self._count_request(req)
        m = self.metrics
        m.count_tokens("decode", "generated", len(result.output_ids))
        m.observe_handoff(result.pages_received, pages.numel() * pages.element_size(),
                          result.handoff_s)
        if kept is not None:
            m.count_kept(kept.kept, kept.kept * self.engine.layout.page_nbytes, kept.by_tier)
        m.observe_e2e(info.compute_s + result.handoff_s + result.decode_s)
        self._set_pools()
