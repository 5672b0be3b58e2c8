"""``DecodeCache``: a decode worker's prefix cache, and the handoff of only what it lacks.

A decode worker keeps, in its own radix cache (the ``kv`` classes prefill uses, the same
page names, each page with its producer's namespace seed), the full pages of every
sequence it decoded: the prompt's and the ones it computed. The router sends the next turn
of that conversation back to it and asks it first how much of the new prompt it holds::

    reserve(req)      match + audit (seed of every page == the request's), lock the hit:
                      -> k, the pages prefill need not send (held until the handoff or
                      ``timeout_s``)
    prefill(req, k)   computes the prompt as ever, hands over pages k.. only
    join(req, info, received)
                      seam check (the reserved pages' names == prefill's names[:k], every
                      seed the request's) -> kept pages + received, unlocked
    keep(...)         at the end of a sequence: its full pages into the radix cache

A prompt's pages enter the cache as soon as its handoff is joined (``hold``), not only when
its answer ends: a request of the same prefix (another client of the tenant, its system
prompt) reserves them while the first one decodes. A handoff announced (``expect``: by the
router when it places a request before its prefill, and when its fetch starts) but not yet
joined makes a reservation it would lengthen wait for it (at most ``ARRIVAL_WAIT_S``;
prefill awaits the answer only once it has computed)::

    A, B arrive together (one tenant)   router: A -> decode d (expect), B -> reserve at d
    d: reserve(B) waits ... A's handoff joined, held -> B's system prompt pages locked
    prefill: A, then B (its system prompt cached) -> B hands over only its own pages

    turn 2 prompt   |p0 p1 p2 p3 p4|p5 p6|p7..      k = 5 (turn 1's prompt and answer)
    handed off                     |p5 p6|p7..      the new pages and the partial last one

A reservation lost (the worker restarted, the timeout passed, the pages were dropped) or a
seam that does not line up is never a wrong answer: the gap is filled by the engine's own
prefill path (its L1/L2, then L3, then recompute) and counted (``keep/lost``,
``keep/seam_mismatch``). Eviction is the radix cache's: least recently used, leaves (tails)
first, within decode's pools; reserved pages are locked.

Thread safety: reservations arrive on the actor's call threads while the batcher's thread
decodes; every touch of the radix cache goes through ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec
import torch

from pd_cache.core.request import Req
from pd_cache.core.vocab import KEEP, KEPT, LOST, REFILLED, RESERVED, SEAM, Tier
from pd_cache.core.wire import PrefillInfo
from pd_cache.kv import CacheKey, MatchResult
from pd_cache.kv.pages import check_pages, page_view
from pd_cache.worker.engine import LocalEngine

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 60.0
ARRIVAL_WAIT_S = 2.0


class Reservation(NamedTuple):
    match: MatchResult
    expires: float   # time.monotonic()


class Incoming(NamedTuple):
    names: tuple[bytes, ...]
    arrived: threading.Event


class Joined(NamedTuple):
    """The prompt's whole page tensor, how many of its pages decode supplied and the tiers
    they came from (pages by tier; a refill's computed pages are in none); ``seam_ok``:
    prefill's page names line up with decode's (else decode names the pages itself)."""

    pages: torch.Tensor
    kept: int
    by_tier: dict[str, int]
    seam_ok: bool = True


class DecodeCache:
    """The prefix cache of one decode worker over its engine's radix cache."""

    def __init__(self, engine: LocalEngine, *, timeout_s: float = RESERVE_TIMEOUT_S) -> None:
        self.engine, self.cache, self.timeout_s = engine, engine.cache, timeout_s
        self.page_size = engine.page_size
        self.algo = engine.config.cache.hash_algo
        self.lock = threading.RLock()
        self._held: dict[str, Reservation] = {}
        self._incoming: dict[str, Incoming] = {}
        self._asked: set[str] = set()   # reservations under way
        self.holds_prompts = not engine.config.model.recurrent_layers

    def reserve(self, req: Req) -> int:
        """Lock the longest prefix of ``req``'s full prompt pages held here that its own
        namespace produced; how many pages that is (0: nothing reserved). A handoff on its
        way here that would lengthen it is waited for first."""
        key = CacheKey.for_request(req, page_size=self.page_size, algo=self.algo)
        seed = req.namespace_seed(self.algo)
        with self.lock:
            self.release(req.rid)   # NOTE: a retried request reserves anew
            self._asked.add(req.rid)
        coming = self._coming(key)
        if coming is not None:
            coming.wait(ARRIVAL_WAIT_S)
        with self.lock:
            if req.rid not in self._asked:   # released while it waited: its request is gone
                return 0
            self._asked.discard(req.rid)
            self.sweep()
            match = self.cache.match_prefix(key)
            good = match.seeded(seed)
            match = self.cache.prefix_of(match, good)
            if not good:
                return 0
            self.cache.lock(match.node)
            self._held[req.rid] = Reservation(match, time.monotonic() + self.timeout_s)
        self.engine.stats.count(KEEP, RESERVED, good)
        return good

    def expect(self, rid: str, names: Sequence[bytes]) -> None:
        """The handoff of a prompt named ``names`` is on its way here (until ``hold`` or
        ``release``); announced twice, it stays the one announcement."""
        if self.holds_prompts and names:
            with self.lock:
                self._incoming.setdefault(rid, Incoming(tuple(names), threading.Event()))

    def _coming(self, key: CacheKey) -> threading.Event | None:
        """The arrival to wait for: a handoff on its way sharing more of ``key`` than the
        cache holds now."""
        with self.lock:
            if not self._incoming:
                return None
            have = self.cache.match_prefix(key).num_pages
            for names, arrived in self._incoming.values():
                if _common(names, key.names) > have:
                    return arrived
        return None

    def hold(self, req: Req, pages: torch.Tensor | None, names: Sequence[bytes] | None) -> None:
        """The prompt's joined ``pages`` (its full ones named ``names``) into the cache, for
        requests of the same prefix while this one decodes; ``None``: it did not arrive (a
        failed fetch, a refused handoff). Ends what ``expect`` announced; never raises (the
        request decodes from its own copy of the pages either way)."""
        try:
            if pages is not None and names and self.holds_prompts:
                full = len(names)
                key = CacheKey(req.namespace, tuple(req.input_ids[:full * self.page_size]),
                               tuple(names), self.page_size)
                with self.lock:
                    self.cache.insert(key, pages[:full], req.namespace_seed(self.algo))
        except Exception:  # noqa: BLE001 - a cache failure never fails the request
            log.exception("request %s: its prompt's pages were not kept on arrival", req.rid)
        finally:
            self._arrived(req.rid)

    def _arrived(self, rid: str) -> None:
        with self.lock:
            coming = self._incoming.pop(rid, None)
        if coming is not None:
            coming.arrived.set()

    def release(self, rid: str) -> bool:
        """Drop ``rid``'s reservation and announced handoff (its request went elsewhere or
        away)."""
        self._arrived(rid)
        with self.lock:
            self._asked.discard(rid)
            held = self._held.pop(rid, None)
            if held is not None:
                self.cache.unlock(held.match.node)
        return held is not None

    def sweep(self) -> int:
        """Release the reservations whose handoff did not come in time."""
        now = time.monotonic()
        with self.lock:
            late = [rid for rid, r in self._held.items() if r.expires <= now]
            for rid in late:
                log.warning("request %s: reservation timed out", rid)
                self.release(rid)
        return len(late)

    @property
    def num_reserved(self) -> int:
        return len(self._held)

    def join(self, req: Req, info: PrefillInfo, received: torch.Tensor) -> Joined:
        """The prompt's pages: the ``info.kept_pages`` reserved here, then ``received``.

        Raises ``ValueError`` if ``received`` is not the rest of the prompt (its pages'
        shape, dtype or count), the reservation released. A reservation missing or not
        matching prefill's names and seed is refilled (never trusted)."""
        kept = info.kept_pages
        with self.lock:
            held = self._held.pop(req.rid, None)
            try:
                check_pages(received, self.engine.layout, field="handoff")
                if received.shape[0] != info.sent_pages:
                    raise ValueError(f"handoff: {received.shape[0]} pages for the "
                                     f"{info.sent_pages} after the {kept} kept")
                # NOTE: one page tensor for the whole prompt: the kept pages read straight
                # into its head, the received ones copied after them.
                pages = self.engine.buffers.take(
                    (kept + received.shape[0], *self.engine.layout.page_shape),
                    self.engine.device_pool.data)
                seam_ok = self._seam_ok(req, held.match if held else None, info, kept)
                by_tier = self._read(req, info, held if seam_ok else None, pages[:kept])
            finally:
                if held is not None:
                    self.cache.unlock(held.match.node)
        pages[kept:].copy_(received)
        return Joined(pages, kept, by_tier, seam_ok)

    def _read(self, req: Req, info: PrefillInfo, held: Reservation | None,
              out: torch.Tensor) -> dict[str, int]:
        """The ``kept`` pages into ``out``: reserved, else refilled (``held`` is ``None``
        when the reservation is gone or its seam did not line up); their pages by tier."""
        kept = info.kept_pages
        if held is None:
            return self._refill(req, kept, out)
        self.engine.stats.count(KEEP, KEPT, kept)
        match = self.cache.prefix_of(self.cache.refresh(held.match), kept)
        self.cache.read_pages(match, out=out)
        return {t.value: match.count(t) for t in (Tier.DEVICE, Tier.HOST)}

    def _seam_ok(self, req: Req, match: MatchResult | None, info: PrefillInfo,
                 kept: int) -> bool:
        """Both sides of the seam name the same chain in the same namespace; the reason
        counted and logged when not."""
        if match is None:
            log.warning("request %s: its reservation of %d pages is gone; refilling",
                        req.rid, kept)
            self.engine.stats.count(KEEP, LOST)
            return True
        pages = match.pages[:kept]
        if kept <= match.num_pages and kept <= len(info.page_names) \
                and all(p.seed == info.seed for p in pages) \
                and tuple(p.name for p in pages) == tuple(info.page_names[:kept]):
            return True
        log.error("request %s: the kept pages do not line up with prefill's; refilling and "
                  "naming the pages here", req.rid)
        self.engine.stats.count(KEEP, SEAM)
        return False

    def _refill(self, req: Req, kept: int, out: torch.Tensor) -> dict[str, int]:
        """The first ``kept`` pages into ``out`` by the engine's prefill path (L1/L2, L3,
        compute) of the prompt cut one token past them (prefill always computes the last
        token); their pages by tier (computed ones in none)."""
        ids = list(req.input_ids[:kept * self.page_size + 1])
        got = self.engine.prefill(msgspec.structs.replace(req, input_ids=ids,
                                                          max_new_tokens=0, output_ids=[]))
        self.engine.stats.count(KEEP, REFILLED, kept)
        out.copy_(got.kv_pages[:kept])
        return {t: n // self.page_size for t, n in got.cached_tokens.items()}

    def keep(self, req: Req, tokens: list[int], buf: torch.Tensor, pos: int,
             states: Mapping[int, torch.Tensor]) -> None:
        """Cache the full pages of a finished sequence (``tokens``: prompt + answer; ``buf``
        its KV ``[2, L, T, Hkv, D]``, valid for ``pos`` tokens; a hybrid model's
        ``states`` by page index)."""
        full = pos // self.page_size
        if not full:
            return
        n = full * self.page_size
        key = CacheKey.for_request(req, tokens[:n], page_size=self.page_size, algo=self.algo)
        # NOTE: a view of the buffer: insert copies only the pages it does not hold yet
        # (most of a conversation's are), never the whole sequence into new memory first.
        pages = page_view(buf[:, :, :n], self.page_size)
        with self.lock:
            kept = self.cache.insert(key, pages, req.namespace_seed(self.algo),
                                     {i: s for i, s in states.items() if i < full})
            if req.pin_ttl_s:   # the prompt's pages, not the answer's
                self.cache.pin(kept.node, req.pin_ttl_s, req.tenant,
                               len(req.input_ids) // self.page_size)

    def close(self) -> None:
        """Release every reservation (the worker is going away)."""
        with self.lock:
            for rid in list(self._held):
                self.release(rid)


def _common(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading names ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
