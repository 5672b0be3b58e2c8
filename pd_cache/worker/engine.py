"""One-process engine: the reference model over the radix cache (L1 device, L2 host).

``generate`` is ``prefill`` then ``decode``; the two are public so that prefill and decode
workers can run them in different processes, handing the prompt's KV pages across::

    prefill(req)  name the prompt's full pages in req's namespace
                  match L1/L2 (lock, load back host pages)  ->  _match_storage (L3 seam:
                  CacheController.fetch prefetches from L3 into host slots, by policy)
                  compute the rest of the prompt, cache its new full pages, unlock,
                  CacheController.write_through: the new full pages to L3 (background)
                  -> PrefillOutput(first token, prompt KV pages, names, cached tokens)
    prefill_first(req)  the same, the write-through left to the caller (``Answered``)
    decode(req, pages, n, first, state, names)  greedy/seeded steps over a private KV
                  buffer; with L3 the DecodeOffloadManager backs up prompt and generated
                  pages (the prompt's under the names prefill gave them)
    start_decode / decode_step / finish_decode   the same, for several requests whose
                  steps run batched in one forward (continuous batching, see batching.py;
                  the decode half lives in decoding.py)

A hybrid model resumes a prefix from its pages' KV and the recurrent state after its last
page, so a cached prefix ends at its last page that has a state (radix node or L3 record;
``pd_cache.kv.state``). Prefill keeps the states of its write's checkpoints (radix, L3)
and hands decode the prompt's (``PromptState``); decode steps the state with the KV.

Not thread-safe: a worker drives it from one loop (L3 writes run on their own thread).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.request import Req
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason, Tier
from pd_cache.kv import CacheKey, MatchResult, PagePool, RadixCache, SlotError
from pd_cache.kv.pages import check_pages, kv_to_pages, num_pages_for, pages_to_kv
from pd_cache.kv.pool import device_pool, host_pool
from pd_cache.kv.state import StatePool, checkpoints
from pd_cache.metrics import PDCacheMetrics
from pd_cache.model.digest import model_layout
from pd_cache.model.hf_model import build_model
from pd_cache.model.model import sample
from pd_cache.storage.base import StorageBackend
from pd_cache.tiering.controller import CacheController, StoredPages
from pd_cache.tiering.offload import DecodeOffloadManager
from pd_cache.worker.buffers import Buffers
from pd_cache.worker.cores import Cores
from pd_cache.worker.decoding import Decoding
from pd_cache.worker.outputs import Answered, PrefillOutput, PromptState, Result

log = logging.getLogger(__name__)


def _nothing() -> None:
    """What follows a prefill without L3."""


class LocalEngine(Decoding):
    """Model, pools and radix cache of one worker. Cache off: ``device_pages=0``.

    ``storage`` (any ``StorageBackend``: an in-process backend or a ``StorageClient`` over
    tier actors) adds L3, unless ``config.storage.enabled`` is false. Prefetched pages land
    in host slots, so L3 reads need ``cache.host_pages > 0``. ``offload_stride`` (tokens)
    is how often decode backs up generated pages; ``storage_timeout_s`` bounds any wait on
    an asynchronous backend. ``metrics`` (optional) records L3 prefetches and writes where the
    tiering layer makes them. ``cores``: what each forward runs on (``worker.cores``; default:
    the process's torch threads, unchanged).
    """

    def __init__(self, config: PDCacheConfig | None = None, *,
                 storage: StorageBackend | None = None, device: torch.device | str = "cpu",
                 offload_stride: int | None = None,
                 storage_timeout_s: float = 30.0,
                 metrics: PDCacheMetrics | None = None, cores: Cores | None = None) -> None:
        self.config = config if config is not None else PDCacheConfig()
        self.cores = cores or Cores()
        # NOTE: config.layout, once pinned weights (if any) are checked to be this model's.
        self.layout = model_layout(self.config)
        self.page_size = self.config.cache.page_size
        self.model = build_model(self.config.model, device)
        self.stats = Stats()
        self.buffers = Buffers()   # decode's per-request buffers, reused
        self.device_pool: PagePool = device_pool(self.layout, int(self.config.cache.device_pages),
                                                 device)
        self.host_pool: PagePool = host_pool(self.layout, int(self.config.cache.host_pages))
        self.state_every = self.config.cache.state_every_pages
        # NOTE: a node holds a device or a host page, and at most one state: this many state
        # slots never run out.
        self.state_pool = (StatePool(self.device_pool.capacity + self.host_pool.capacity,
                                     self.layout, device) if self.layout.has_state else None)
        self.cache = RadixCache(self.device_pool, self.host_pool,
                                write_policy=self.config.cache.write_policy, stats=self.stats,
                                states=self.state_pool,
                                max_pinned_fraction=self.config.cache.max_pinned_fraction)
        self.controller: CacheController | None = None
        self.offload: DecodeOffloadManager | None = None
        if storage is not None and self.config.storage.enabled:
            self.controller = CacheController(storage, self.host_pool, self.config.storage,
                                              algo=self.config.cache.hash_algo,
                                              stats=self.stats, alloc=self._host_slots,
                                              call_timeout_s=storage_timeout_s,
                                              metrics=metrics, state_every=self.state_every)
            self.offload = DecodeOffloadManager(
                self.controller, stride=offload_stride,
                min_pages=self.config.storage.offload_min_pages)

    # -- the request path -----------------------------------------------------------------

    def generate(self, req: Req) -> Result:
        """Prefill then decode in this process; fills ``req.output_ids``."""
        out = self.prefill(req)
        tokens = self.decode(req, out.kv_pages, out.num_prompt_tokens, out.first_token,
                             out.state, out.page_names, out.l3_pages)
        return Result(req.rid, tokens, out.cached_tokens, out.logits)

    def prefill(self, req: Req, l3_pages: int | None = None) -> PrefillOutput:
        """Compute the prompt's KV (reusing cached pages) and draw the first token.

        ``l3_pages``: how many leading pages of the prompt's chain L3 holds, as a page index
        says (``CacheController.fetch``; ``None``: no index).

        Raises ``ValueError`` for a request the model cannot serve (a token id outside the
        vocabulary, prompt plus ``max_new_tokens`` beyond the context); nothing is cached then.
        """
        out, backup = self.prefill_first(req, l3_pages)
        backup()
        return out

    def prefill_first(self, req: Req, l3_pages: int | None = None) -> Answered:
        """``prefill`` whose L3 write-through is not yet issued: ``after()`` issues it. The
        prompt's pages are cached already; only the background write waits, so that a
        worker answers before its writer thread competes for the interpreter."""
        self._check_request(req)
        key = CacheKey.for_request(req, page_size=self.page_size,
                                   algo=self.config.cache.hash_algo)
        # NOTE: at least the last prompt token is always computed: its logits give token 0.
        usable = (len(req.input_ids) - 1) // self.page_size
        seed = req.namespace_seed(self.config.cache.hash_algo)
        match, refused = self._audit(req, self.cache.match_prefix(key, max_pages=usable), seed)
        self.cache.lock(match.node)
        try:
            return self._prefill_locked(req, key, match, usable, seed, refused, l3_pages)
        finally:
            self.cache.unlock(match.node)

    def _audit(self, req: Req, match: MatchResult, seed: bytes) -> tuple[MatchResult, int]:
        """``match`` up to its first page another namespace produced, and how many pages
        that refuses. Independent of the lookup: it compares the seed each page was stored
        with against the request's own."""
        good = match.seeded(seed)
        refused = match.num_pages - good
        if refused:
            log.error("request %s: %d cached pages were produced in another namespace; "
                      "refused and recomputed", req.rid, refused)
            self.stats.count(Event.MISS, MissReason.CROSS_NAMESPACE, refused)
        return self.cache.prefix_of(match, good), refused

    def _prefill_locked(self, req: Req, key: CacheKey, match: MatchResult, usable: int,
                        seed: bytes, refused: int, l3_pages: int | None) -> Answered:
        wanted = key.names[match.num_pages:usable]
        stored = self._match_storage(req, wanted, key.names[:match.num_pages], l3_pages)
        check_pages(stored.pages, self.layout, field="_match_storage: pages")
        if stored.pages.shape[0] > len(wanted):
            raise ValueError(f"_match_storage: pages: {stored.pages.shape[0]} pages for "
                             f"{len(wanted)} names")
        if not stored.pages.shape[0]:   # a hybrid local hit ends at its last state
            match = self.cache.prefix_of(match, self.cache.resume_pages(match))
        known = self._resumed_states(match, stored)
        local, done = match.num_pages, match.num_pages + stored.pages.shape[0]
        num_cached = done * self.page_size
        # NOTE: one page tensor for the whole prompt, filled in place: cached pages gathered
        # from their slots (host pages loaded back to device from there), then L3's, then
        # the computed ones. ``match`` keeps the tiers the pages were found in.
        pages = self.device_pool.data.new_empty(
            (num_pages_for(len(req.input_ids), self.page_size), *self.layout.page_shape))
        self.cache.load_back(match, self.cache.read_pages(match, out=pages[:local]))
        pages[local:done].copy_(stored.pages)
        prefix_kv = pages_to_kv(pages[:done], num_cached, self.layout)
        with self.cores.forward(len(req.input_ids) - num_cached):
            out = self.model(req.input_ids[num_cached:], prefix_kv, state=known.get(done - 1),
                             state_at=self._state_at(done, key.num_pages))
        kv_to_pages(out.kv, self.page_size, out=pages[done:])
        kept = {} if out.states is None else dict(zip(
            checkpoints(done, key.num_pages - 1, self.state_every), out.states))
        inserted = self.cache.insert(key, pages, seed, {**known, **kept})
        if req.pin_ttl_s:
            self.cache.pin(inserted.node, req.pin_ttl_s, req.tenant)
        backup: Callable[[], None] = _nothing
        if self.controller is not None:
            # NOTE: writes skip what L3 holds: what it supplied, and what the index says it
            # holds past that (unless the read found the index stale).
            held = done if l3_pages is None or stored.stale else max(done, l3_pages)
            backup = functools.partial(self.controller.write_through, req, key, held, pages,
                                       kept)
            l3_pages = self.controller.held_after(key.names, local, l3_pages, stored.stale)
        logits = out.logits[-1]
        cached = {Tier.DEVICE.value: match.count(Tier.DEVICE) * self.page_size,
                  Tier.HOST.value: match.count(Tier.HOST) * self.page_size,
                  Tier.STORAGE.value: stored.pages.shape[0] * self.page_size}
        state = None if out.state is None else PromptState(out.state, {**known, **kept})
        return Answered(PrefillOutput(req.rid, sample(logits, req.sampling, 0), pages,
                                      len(req.input_ids), key.names, cached, logits, seed,
                                      refused + stored.cross_namespace, state,
                                      None if self.controller is None else l3_pages), backup)

    def _state_at(self, done: int, num_pages: int) -> list[int]:
        """Counts of new tokens after which a hybrid prefill keeps the state: the ends of
        its checkpoint pages (none for a plain model)."""
        if not self.layout.has_state:
            return []
        ps = self.page_size
        return [(i + 1 - done) * ps for i in checkpoints(done, num_pages - 1, self.state_every)]

    def _resumed_states(self, match: MatchResult,
                        stored: StoredPages) -> dict[int, torch.Tensor]:
        """A hybrid prefix's known states by page index: what L3 supplied, or the state of
        the local hit's last page (the one prefill resumes from). Empty when plain."""
        if not self.layout.has_state:
            return {}
        if stored.pages.shape[0]:
            return {match.num_pages + i: s for i, s in (stored.states or {}).items()}
        if not match.num_pages:
            return {}
        return {match.num_pages - 1: self.cache.read_state(match, match.num_pages)}

    def _match_storage(self, req: Req, names: tuple[bytes, ...], prefix: tuple[bytes, ...],
                       l3_pages: int | None = None) -> StoredPages:
        """KV of the leading pages of ``names`` that a lower tier (L3) can supply.

        ``names`` are the prompt's page names right after the local L1/L2 hit, ``prefix``
        those of the hit, in ``req``'s namespace. Returns ``[k, *page_shape]`` for the first
        ``k`` of them; the engine computes the rest. Without L3, ``k = 0``.
        """
        if self.controller is None or not names:
            return StoredPages(torch.empty((0, *self.layout.page_shape),
                                           dtype=self.device_pool.data.dtype))
        return self.controller.fetch(req, names, prefix, l3_pages)

    def _host_slots(self, n: int, owner: str) -> list[int]:
        """Up to ``n`` host slots for ``owner``, evicting unlocked L2 pages to make room."""
        if self.host_pool.num_free < n:
            self.cache.evict(Tier.HOST, n - self.host_pool.num_free)
        return self.host_pool.alloc(min(n, self.host_pool.num_free), owner)

    # -- for tests and operators ----------------------------------------------------------

    def pool_usage(self) -> dict[str, dict[str, int]]:
        """Slots held per pool, by owner (``"radix"`` for cached pages; a hybrid model's
        ``state`` pool too)."""
        usage = {"device": self.device_pool.usage(), "host": self.host_pool.usage()}
        if self.state_pool is not None:
            usage["state"] = self.state_pool.usage()
        return usage

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every L3 backup and offload write issued so far (``True``: all done)."""
        return True if self.controller is None else self.controller.flush(timeout)

    def controller_stats(self) -> dict[str, int]:
        """Snapshot of every count (``"event/reason": n``), L3 prefetch and writes included."""
        return self.stats.snapshot()

    def locks_held(self) -> int:
        """Cache locks taken and not yet released; zero between requests."""
        return self.cache.num_locks

    def drop_cache(self) -> dict[str, int]:
        """Empty L1 and L2 once pending L3 writes are done (an operator's reset between a
        benchmark's warm-up and its measurement); pages by tier dropped. Pages a request in
        flight holds stay (locked), so a drop never breaks a running request."""
        self.flush()
        before = {"device": self.cache.num_device_pages, "host": self.cache.num_host_pages}
        self.cache.clear()
        return {"device": before["device"] - self.cache.num_device_pages,
                "host": before["host"] - self.cache.num_host_pages}

    def close(self) -> None:
        """Drop the cache and check that no lock or slot leaked (``SlotError`` if one did).

        Pending L3 writes are finished first.
        """
        if self.controller is not None:
            self.controller.close()
        if self.cache.num_locks:
            raise SlotError(f"engine: {self.cache.num_locks} cache locks still held at close")
        self.cache.check_invariants()
        self.cache.clear()
        self.device_pool.close()
        self.host_pool.close()
        if self.state_pool is not None:
            self.state_pool.close()
