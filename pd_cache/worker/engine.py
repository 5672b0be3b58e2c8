"""One-process engine: the reference model over the radix cache (L1 device, L2 host).

``generate`` is ``prefill`` then ``decode``; the two are public so that prefill and decode
workers can run them in different processes, handing the prompt's KV pages across::

    prefill(req)  name the prompt's full pages in req's namespace
                  match L1/L2 (lock, load back host pages)  ->  _match_storage (L3 seam:
                  the CacheController prefetches from L3 into host slots, by policy)
                  compute the rest of the prompt, cache its new full pages, unlock,
                  write the new full pages through to L3 in the background
                  -> PrefillOutput(first token, prompt KV pages, names, cached tokens)
    decode(req, pages, n, first)  greedy/seeded steps over a private KV buffer; with L3
                  the DecodeOffloadManager backs up prompt and generated pages
    start_decode / decode_step / finish_decode   the same, for several requests whose
                  steps run batched in one forward (continuous batching, see batching.py)

Not thread-safe: a worker drives it from one loop (L3 writes run on their own thread).
"""

from __future__ import annotations

import logging

import torch

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.hashing import namespace_seed, to_hex
from pd_cache.core.request import Req
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import DECODE, Event, MissReason, Tier
from pd_cache.kv import CacheKey, MatchResult, PagePool, RadixCache, SlotError
from pd_cache.kv.pool import device_pool, host_pool
from pd_cache.metrics import PDCacheMetrics
from pd_cache.storage.base import StorageBackend
from pd_cache.tiering.controller import CacheController
from pd_cache.tiering.offload import DecodeOffloadManager
from pd_cache.worker.digest import model_layout
from pd_cache.worker.hf_model import build_model
from pd_cache.worker.model import check_pages, kv_to_pages, pages_to_kv, sample
from pd_cache.worker.outputs import DecodeSeq, PrefillOutput, Result, StoredPages

log = logging.getLogger(__name__)


class LocalEngine:
    """Model, pools and radix cache of one worker. Cache off: ``device_pages=0``.

    ``storage`` (any ``StorageBackend``: an in-process backend or a ``StorageClient`` over
    tier actors) adds L3, unless ``config.storage.enabled`` is false. Prefetched pages land
    in host slots, so L3 reads need ``cache.host_pages > 0``. ``offload_stride`` (tokens)
    is how often decode backs up generated pages; ``storage_timeout_s`` bounds any wait on
    an asynchronous backend. ``metrics`` (optional) records L3 prefetches and writes where the
    tiering layer makes them.
    """

    def __init__(self, config: PDCacheConfig | None = None, *,
                 storage: StorageBackend | None = None, device: torch.device | str = "cpu",
                 offload_stride: int | None = None,
                 storage_timeout_s: float = 30.0,
                 metrics: PDCacheMetrics | None = None) -> None:
        self.config = config if config is not None else PDCacheConfig()
        # NOTE: config.layout, once pinned weights (if any) are checked to be this model's.
        self.layout = model_layout(self.config)
        self.page_size = self.config.cache.page_size
        self.model = build_model(self.config.model, device)
        self.stats = Stats()
        self.device_pool: PagePool = device_pool(self.layout, int(self.config.cache.device_pages),
                                                 device)
        self.host_pool: PagePool = host_pool(self.layout, int(self.config.cache.host_pages))
        self.cache = RadixCache(self.device_pool, self.host_pool,
                                write_policy=self.config.cache.write_policy, stats=self.stats)
        self.controller: CacheController | None = None
        self.offload: DecodeOffloadManager | None = None
        if storage is not None and self.config.storage.enabled:
            self.controller = CacheController(storage, self.host_pool, self.config.storage,
                                              algo=self.config.cache.hash_algo,
                                              stats=self.stats, alloc=self._host_slots,
                                              call_timeout_s=storage_timeout_s,
                                              metrics=metrics)
            self.offload = DecodeOffloadManager(self.controller, stride=offload_stride)

    # -- the request path -----------------------------------------------------------------

    def generate(self, req: Req) -> Result:
        """Prefill then decode in this process; fills ``req.output_ids``."""
        out = self.prefill(req)
        tokens = self.decode(req, out.kv_pages, out.num_prompt_tokens, out.first_token)
        return Result(req.rid, tokens, out.cached_tokens, out.logits)

    def prefill(self, req: Req) -> PrefillOutput:
        """Compute the prompt's KV (reusing cached pages) and draw the first token.

        Raises ``ValueError`` for a request the model cannot serve (a token id outside the
        vocabulary, prompt plus ``max_new_tokens`` beyond the context); nothing is cached then.
        """
        self._check_request(req)
        key = CacheKey.for_request(req, page_size=self.page_size,
                                   algo=self.config.cache.hash_algo)
        # NOTE: at least the last prompt token is always computed: its logits give token 0.
        usable = (len(req.input_ids) - 1) // self.page_size
        seed = namespace_seed(req.extra_key, req.cache_salt, self.config.cache.hash_algo)
        match, refused = self._audit(req, self.cache.match_prefix(key, max_pages=usable), seed)
        self.cache.lock(match.node)
        try:
            return self._prefill_locked(req, key, match, usable, seed, refused)
        finally:
            self.cache.unlock(match.node)

    def _audit(self, req: Req, match: MatchResult, seed: bytes) -> tuple[MatchResult, int]:
        """``match`` up to its first page another namespace produced, and how many pages
        that refuses. Independent of the lookup: it compares the seed each page was stored
        with against the request's own."""
        good = next((i for i, p in enumerate(match.pages) if p.seed != seed), match.num_pages)
        refused = match.num_pages - good
        if refused:
            log.error("request %s: %d cached pages were produced in another namespace; "
                      "refused and recomputed", req.rid, refused)
            self.stats.count(Event.MISS, MissReason.CROSS_NAMESPACE, refused)
        return self.cache.prefix_of(match, good), refused

    def _prefill_locked(self, req: Req, key: CacheKey, match: MatchResult, usable: int,
                        seed: bytes, refused: int) -> PrefillOutput:
        # NOTE: ``match`` keeps the tiers the pages were found in; load-back moves them.
        prefix = self.cache.read_pages(self.cache.load_back(match))
        wanted = key.names[match.num_pages:usable]
        stored = self._match_storage(req, wanted, key.names[:match.num_pages])
        check_pages(stored.pages, self.layout, field="_match_storage: pages")
        if stored.pages.shape[0] > len(wanted):
            raise ValueError(f"_match_storage: pages: {stored.pages.shape[0]} pages for "
                             f"{len(wanted)} names")
        prefix = torch.cat([prefix, stored.pages.to(prefix.device)])
        num_cached = prefix.shape[0] * self.page_size
        prefix_kv = pages_to_kv(prefix, num_cached, self.layout)
        out = self.model(req.input_ids[num_cached:], prefix_kv)
        pages = kv_to_pages(torch.cat([prefix_kv, out.kv], dim=2), self.page_size)
        self.cache.insert(key, pages, seed)
        self._write_through(req, key, prefix.shape[0], pages)
        logits = out.logits[-1]
        cached = {Tier.DEVICE.value: match.count(Tier.DEVICE) * self.page_size,
                  Tier.HOST.value: match.count(Tier.HOST) * self.page_size,
                  Tier.STORAGE.value: stored.pages.shape[0] * self.page_size}
        return PrefillOutput(req.rid, sample(logits, req.sampling, 0), pages,
                             len(req.input_ids), key.names, cached, logits, seed,
                             refused + stored.cross_namespace)

    def _match_storage(self, req: Req, names: tuple[bytes, ...],
                       prefix: tuple[bytes, ...]) -> StoredPages:
        """KV of the leading pages of ``names`` that a lower tier (L3) can supply.

        ``names`` are the prompt's page names right after the local L1/L2 hit, ``prefix``
        those of the hit, in ``req``'s namespace. Returns ``[k, *page_shape]`` for the first
        ``k`` of them; the engine computes the rest. Without L3, ``k = 0``.
        """
        if self.controller is None or not names:
            return StoredPages(torch.empty((0, *self.layout.page_shape),
                                           dtype=self.device_pool.data.dtype))
        fetched = self.controller.prefetch(req, names, prefix)
        try:
            return StoredPages(fetched.read(), fetched.cross_namespace)
        finally:
            fetched.release()

    def _host_slots(self, n: int, owner: str) -> list[int]:
        """Up to ``n`` host slots for ``owner``, evicting unlocked L2 pages to make room."""
        if self.host_pool.num_free < n:
            self.cache.evict(Tier.HOST, n - self.host_pool.num_free)
        return self.host_pool.alloc(min(n, self.host_pool.num_free), owner)

    def _write_through(self, req: Req, key: CacheKey, num_cached: int,
                       pages: torch.Tensor) -> None:
        """Back up the prompt's newly computed full pages to L3, in the background."""
        if self.controller is None or num_cached >= key.num_pages:
            return
        ps = self.page_size
        self.controller.backup(req, key.names[num_cached:],
                               key.tokens[num_cached * ps:key.num_pages * ps],
                               pages[num_cached:key.num_pages], key.names[:num_cached])

    def compute_prompt(self, req: Req) -> tuple[torch.Tensor, int]:
        """The prompt's KV pages and first token computed from scratch, no cache touched
        (what decode falls back to when handed-off KV fails its audit)."""
        self._check_request(req)
        out = self.model(req.input_ids, None)
        return kv_to_pages(out.kv, self.page_size), sample(out.logits[-1], req.sampling, 0)

    def decode(self, req: Req, prompt_kv_pages: torch.Tensor, num_prompt_tokens: int,
               first_token: int) -> list[int]:
        """Generate ``req.max_new_tokens`` tokens after the prompt; fills ``req.output_ids``.

        ``prompt_kv_pages`` are treated as read-only (they may be a shared-memory view).
        Raises ``ValueError`` if they have the wrong shape, dtype or page count, or if
        ``num_prompt_tokens`` or ``first_token`` do not fit the request and the model.
        One request alone; ``start_decode`` / ``decode_step`` / ``finish_decode`` run
        several in one batch.
        """
        seq = self.start_decode(req, prompt_kv_pages, num_prompt_tokens, first_token)
        while not seq.done:
            req.check_deadline("decode")
            self.decode_step([seq])
        return self.finish_decode(seq)

    def start_decode(self, req: Req, prompt_kv_pages: torch.Tensor, num_prompt_tokens: int,
                     first_token: int) -> DecodeSeq:
        """Check the handoff, copy the prompt's KV into a private buffer, start offload."""
        self._check_request(req)
        if num_prompt_tokens != len(req.input_ids):
            raise ValueError(f"num_prompt_tokens: {num_prompt_tokens} != prompt length "
                             f"{len(req.input_ids)} of request {req.rid!r}")
        vocab = self.config.model.vocab_size
        if isinstance(first_token, bool) or not isinstance(first_token, int) \
                or not 0 <= first_token < vocab:
            raise ValueError(f"first_token: expected a token id in [0, {vocab}), got "
                             f"{first_token!r}")
        kv = pages_to_kv(prompt_kv_pages, num_prompt_tokens, self.layout)
        state = None
        if self.offload is not None:
            state = self.offload.offload_kv_cache(req, prompt_kv_pages)
        n, steps = num_prompt_tokens, req.max_new_tokens
        # NOTE: one buffer for the whole sequence; the last token's KV is never needed.
        buf = kv.new_empty((*kv.shape[:2], n + max(steps, 1) - 1, *kv.shape[3:]))
        buf[:, :, :n] = kv
        tokens = [first_token] if steps else []
        return DecodeSeq(req, buf, n, tokens, list(req.input_ids) + tokens, state)

    def decode_step(self, seqs: list[DecodeSeq]) -> None:
        """One token for every unfinished sequence of ``seqs``, in one batched forward."""
        live = [s for s in seqs if not s.done]
        if not live:
            return
        logits = self.model.decode_step([s.tokens[-1] for s in live], [s.buf for s in live],
                                        [s.pos for s in live])
        self.stats.count(DECODE, "step")
        self.stats.count(DECODE, "token", len(live))
        for seq, row in zip(live, logits):
            token = sample(row, seq.req.sampling, len(seq.tokens))
            seq.tokens.append(token)
            seq.seq.append(token)
            seq.pos += 1
            if seq.state is not None:
                self.offload.advance(seq.state, seq.seq, seq.buf, seq.pos)

    def finish_decode(self, seq: DecodeSeq) -> list[int]:
        """Offload the last full pages; fills ``req.output_ids``; returns the tokens."""
        if seq.state is not None and seq.req.max_new_tokens:
            self.offload.advance(seq.state, seq.seq, seq.buf, seq.pos, final=True)
        seq.req.output_ids = list(seq.tokens)
        return list(seq.tokens)

    def _check_request(self, req: Req) -> None:
        req.check_model(vocab_size=self.config.model.vocab_size,
                        max_context=self.config.model.max_context)

    # -- for tests and operators ----------------------------------------------------------

    def pool_usage(self) -> dict[str, dict[str, int]]:
        """Slots held per pool, by owner (``"radix"`` for cached pages)."""
        return {"device": self.device_pool.usage(), "host": self.host_pool.usage()}

    def page_names(self, req: Req) -> list[str]:
        """Hex names of ``req``'s full prompt pages as this process computes them (debug)."""
        key = CacheKey.for_request(req, page_size=self.page_size,
                                   algo=self.config.cache.hash_algo)
        return [to_hex(name) for name in key.names]

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
