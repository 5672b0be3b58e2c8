"""The read path: L3 -> host slots, verified, batch by batch.

    prefetch  the chain's names past the local hit (below ``l3_pages`` when a page index
              gave it) -> submit every get, then verify each batch in order (wait by
              policy), one ack per batch issued -> host slots for the pages that came

No ``exists`` before the read: the get is the lookup, and a page it does not return is a
miss (``not_stored``, or ``stale_index`` when an index said L3 held it). A page that does
not arrive in time, does not verify, or is missing ends the prefetch there: the pages
after it are recomputed. Without an index, host slots are taken only for the verified
pages, so a miss evicts nothing from L2; with one, they are taken before the read and a
store that can (sealed L3) opens each record straight into its slot, and ``best_effort``
waits for them as ``timeout`` does. A hybrid model without an index still asks ``exists``
first (its resume point is the hit's last page, whose state the read must ask for).

A hybrid model's batches end at the pages where a recurrent state may be kept (every
``state_every`` pages, and the last page of the hit); each such batch is one
``batch_get_v2`` of its KV and, as a trailing sidecar, the ``state`` of its last page::

    pages     4  5  6  7 | 8  9 10 11 | 12 13       after a local hit of 4, every = 4
    kv        x  x  x  x | x  x  x  x | x  x        (one v2 get per batch)
    state              ? |          ? |     ?       states found: the resumable ends

A state that is missing or does not verify is never served: the prefix then ends at the
last page before it that has one (``Prefetched.resume_pages``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pd_cache.core.request import Req
from pd_cache.core.vocab import PREFETCH_ACK, PREFETCH_BATCH, STATE, Event, MissReason, Tier
from pd_cache.kv.pool import PagePool
from pd_cache.storage.base import Pending, PoolTransfer
from pd_cache.storage.record import KV_POOL, STATE_POOL, PageRecord, verify
from pd_cache.tiering.chain import Chain, runs
from pd_cache.tiering.link import StorageLink

log = logging.getLogger("pd_cache.tiering")

Alloc = Callable[[int, str], list[int]]
Answer = dict[str, list[Any]]   # pool -> a record or None per key asked


class Prefetched:
    """Pages a prefetch landed in host slots, in chain order; ``release`` frees the slots.

    ``cross_namespace`` counts records refused because another namespace produced them.
    ``states`` (hybrid models): the verified recurrent state after page ``i`` of the
    landed pages, where one was found. ``stale``: a page an index said L3 held was not.
    """

    def __init__(self, pool: PagePool, slots: list[int], owner: str,
                 cross_namespace: int = 0, states: dict[int, torch.Tensor] | None = None,
                 has_state: bool = False, stale: bool = False) -> None:
        self.pool, self.slots, self.owner, self.stale = pool, slots, owner, stale
        self.cross_namespace = cross_namespace
        self.states, self.has_state = states or {}, has_state

    @property
    def num_pages(self) -> int:
        return len(self.slots)

    @property
    def resume_pages(self) -> int:
        """Landed pages a request can resume from: all of them for a plain model; for a
        hybrid one, up to the last page with a state (0 if none)."""
        if not self.has_state:
            return self.num_pages
        return max((i + 1 for i in self.states if i < self.num_pages), default=0)

    def read(self) -> torch.Tensor:
        """A copy of the landed pages, ``[num_pages, *page_shape]``."""
        return self.pool.read(self.slots)

    def release(self) -> None:
        """Free the slots (the pool raises ``SlotError`` if called twice)."""
        self.pool.free(self.slots, self.owner)


class Prefetcher:
    """Loads the leading pages of a chain that L3 holds into host slots.

    ``alloc(n, owner)`` hands out up to ``n`` host slots (the engine evicts L2 pages to
    make room). Runs on the caller's thread.
    """

    def __init__(self, link: StorageLink, host: PagePool, alloc: Alloc | None = None) -> None:
        self.link, self.host = link, host
        self.config, self.stats = link.config, link.stats
        self._alloc = alloc if alloc is not None else self._alloc_free

    def prefetch(self, req: Req, names: Sequence[bytes], prefix: Sequence[bytes] = (),
                 policy: str | None = None, l3_pages: int | None = None) -> Prefetched:
        """Load the leading pages of ``names`` (after ``prefix``) that L3 holds.

        ``names`` are the prompt's page names right after its local hit, ``prefix`` the
        names before them, both in ``req``'s namespace as the caller computed them. No
        ``exists`` is asked: the get is the lookup. ``l3_pages`` (a page index's answer:
        how many leading pages of the request's chain L3 holds) reads only the pages below
        it, and one the shard no longer holds is a ``stale_index`` miss; ``None`` reads
        every page of ``names`` the host pool could hold (the wait: ``policy``). Returns
        the pages that landed, verified, in order; the caller reads them and ``release``s."""
        owner, started = f"prefetch:{req.rid}", time.perf_counter()
        chain = Chain.of(req, names, prefix, algo=self.link.algo)
        asked = self._asked(req, chain, l3_pages)
        # NOTE: the index said L3 holds these pages: their slots are worth taking first.
        into = self._alloc(asked, owner) if asked and l3_pages is not None \
            and not self.link.has_state and hasattr(self.link.storage, "submit_get_into") \
            else None
        asked = asked if into is None else len(into)
        good: list[torch.Tensor] = []
        refused: list[bytes] = []
        states: dict[int, torch.Tensor] = {}
        reason: MissReason | None = None
        try:
            if asked:
                reason = self._load(req, chain._replace(names=chain.names[:asked]),
                                    self.policy(policy, l3_pages), refused, states, good,
                                    stale=l3_pages is not None, into=into)
        except Exception as e:  # noqa: BLE001 - a malformed answer is a miss, never a failure
            self.link.fault(req, "prefetch", MissReason.STORAGE_ERROR, e, asked)
            good, reason = [], MissReason.STORAGE_ERROR
        if len(chain.names) > asked:
            self.stats.count(Event.MISS, MissReason.NOT_STORED, len(chain.names) - asked)
        slots = self._place(good, owner, into)
        if slots:
            self.stats.count(Event.HIT, Tier.STORAGE, len(slots))
        # NOTE: a page L3 does not hold is a lookup's answer, not a failed transfer.
        wanted = len(good) if reason in (None, MissReason.NOT_STORED) else asked
        self.link.observe("prefetch", len(slots), wanted, started)
        return Prefetched(self.host, slots, owner, len(refused), states, self.link.has_state,
                          reason is MissReason.STALE_INDEX)

    def _place(self, good: list[torch.Tensor], owner: str, into: list[int] | None) -> list[int]:
        """Host slots holding ``good``, in order: ``into``'s leading ones (the rest freed;
        pages a store opened straight into them are there already), else new ones."""
        if into is None:
            slots = self._alloc(len(good), owner) if good else []
            if slots:
                self.host.write(slots, torch.stack(good[:len(slots)]))
            return slots
        slots = into[:len(good)]
        self.host.free(into[len(slots):], owner)
        moved = [(slot, page) for slot, page in zip(slots, good)
                 if page.data_ptr() != self.host.data[slot].data_ptr()]
        if moved:
            self.host.write([slot for slot, _ in moved], torch.stack([p for _, p in moved]))
        return slots

    def _asked(self, req: Req, chain: Chain, l3_pages: int | None) -> int:
        """How many of ``chain.names`` to read: those below ``l3_pages``, else as many as
        the host pool holds; a hybrid model with no ``l3_pages`` asks L3 first, as its
        resume point needs the state of the hit's last page, which only the hit names."""
        if l3_pages is not None:
            return max(0, min(len(chain.names), l3_pages - len(chain.prefix)))
        if self.link.has_state and chain.names:
            return self.link.query(req, chain, count=False)
        return min(len(chain.names), self.host.capacity)

    def policy(self, policy: str | None, l3_pages: int | None) -> str:
        """``policy``, else the config's; ``best_effort`` waits as ``timeout`` does for what
        a page index vouches for (``l3_pages``): a bounded wait beats a recompute."""
        policy = policy or self.config.prefetch_policy
        return "timeout" if policy == "best_effort" and l3_pages is not None else policy

    def deadline(self, policy: str, num_tokens: int) -> float | None:
        """When the policy stops waiting (``time.monotonic()`` scale); ``None``: no wait."""
        if policy == "best_effort":
            return None
        if policy == "wait_complete":
            return time.monotonic() + self.link.call_timeout_s
        c = self.config
        bound = c.prefetch_timeout_base_s + c.prefetch_timeout_per_1k_tokens_s * num_tokens / 1e3
        return time.monotonic() + min(bound, c.prefetch_timeout_max_s)

    def _load(self, req: Req, chain: Chain, policy: str, refused: list[bytes],
              states: dict[int, torch.Tensor], good: list[torch.Tensor], *,
              stale: bool, into: list[int] | None = None) -> MissReason | None:
        """Submit every batch, then verify them in order into ``good`` (the KV of the
        leading pages that verified); one ack per batch issued. Names of records another
        namespace produced are added to ``refused``, verified states to ``states``.
        Returns why the pages stopped (``None``: all of them came); the asked pages that
        did not come are counted under it (``stale``: a missing one is ``stale_index``).
        ``into``: host slots the records may be opened straight into, one per name."""
        asks = self._state_pages(chain)
        batches = runs(len(chain.names), self.config.batch_pages, asks)
        prefix, issued = self.link.start_prefix(chain), []
        for run in batches:
            batch = chain.names[run.start:run.stop]
            rows = None if into is None else self.host.rows(into[run.start:run.stop])
            issued.append(self._submit_get(batch, run.stop - 1 in asks,
                                           self.link.info(req, chain, prefix), rows))
            self.stats.count(PREFETCH_BATCH)
            prefix = None if prefix is None else prefix + batch
        deadline = self.deadline(policy, len(chain.names) * self.link.page_size)
        reason = None
        for run, pending in zip(batches, issued):
            if reason is None:
                reason = self._land(req, chain, run, pending, deadline, refused, states, good,
                                    stale)
                if reason is not None and len(chain.names) > run.stop:
                    self.stats.count(Event.MISS, reason, len(chain.names) - run.stop)
            self.stats.count(PREFETCH_ACK, "short" if reason is not None else "ok")
        return reason

    def _state_pages(self, chain: Chain) -> set[int]:
        """Indexes of ``chain.names`` whose state the read path asks for (hybrid only)."""
        if not self.link.has_state or not chain.names:
            return set()
        every, before, n = self.link.state_every, len(chain.prefix), len(chain.names)
        return {i for i in range(n) if (before + i + 1) % every == 0} | {n - 1}

    def _submit_get(self, batch: list[bytes], with_state: bool, info: Any,
                    rows: list[torch.Tensor] | None = None) -> Pending[Answer] | Exception:
        """One batch's get: its KV (the v1 call; opened straight into ``rows`` if given),
        or KV and, as a trailing sidecar, its last page's state (``batch_get_v2``)."""
        storage = self.link.storage
        try:
            if not with_state and rows is not None:
                return storage.submit_get_into(batch, rows, info).then(_kv_answer)
            if not with_state:
                return storage.submit_get(batch, info).then(_kv_answer)
            transfers = [PoolTransfer(KV_POOL, batch), PoolTransfer(STATE_POOL, batch[-1:])]
            return storage.submit_get_v2(transfers, info).then(_answer)
        except Exception as e:  # noqa: BLE001 - counted when the batch is landed
            return e

    def _land(self, req: Req, chain: Chain, run: range, pending: Pending[Answer] | Exception,
              deadline: float | None, refused: list[bytes], states: dict[int, torch.Tensor],
              good: list[torch.Tensor], stale: bool) -> MissReason | None:
        """Verify one batch's records and add the leading good ones to ``good``; keep the
        batch's state if it asked for one and every page of the batch verified. Returns
        why the batch fell short (its missing pages counted), ``None`` if it did not."""
        start, batch = run.start, chain.names[run.start:run.stop]
        answer = self._wait(req, pending, deadline, len(batch))
        if isinstance(answer, MissReason):
            return answer
        records = _padded(answer.get(KV_POOL), len(batch))   # short: misses
        for i, (name, record) in enumerate(zip(batch, records)):
            reason = self._check(req, record, name, chain.prior(start + i), chain.seed,
                                 self._page_tokens(req, chain, start + i), KV_POOL)
            if reason is MissReason.CROSS_NAMESPACE:
                refused.extend(batch[i:])   # counted like every miss: the pages it costs
            if reason is not None:
                if record is None and isinstance(pending, Pending):
                    reason = _missing_reason(pending, stale)
                self.stats.count(Event.MISS, reason, len(batch) - i)
                self.link.held.add(batch[:i])   # what it did read: L3 holds it
                return reason
            good.append(record.payload(KV_POOL))
        self.link.held.add(batch)
        if STATE_POOL in answer:
            self._keep_state(req, chain, run.stop - 1, _padded(answer[STATE_POOL], 1)[0],
                             states)
        return None

    def _keep_state(self, req: Req, chain: Chain, i: int, record: PageRecord | None,
                    states: dict[int, torch.Tensor]) -> None:
        """Add the state after page ``i`` to ``states`` if ``record`` verifies as it."""
        reason = self._check(req, record, chain.names[i], chain.prior(i), chain.seed,
                             self._page_tokens(req, chain, i), STATE_POOL)
        self.stats.count(STATE, "hit" if reason is None else reason)
        if reason is None:
            # NOTE: a copy: the payload may be a read-only view of shared memory.
            states[i] = record.payload(STATE_POOL).clone()

    def _wait(self, req: Req, pending: Pending[Answer] | Exception, deadline: float | None,
              n: int) -> Answer | MissReason:
        """The batch's answer, or why there is none (its ``n`` pages counted)."""
        if isinstance(pending, Exception):
            self.link.fault(req, "get", MissReason.STORAGE_ERROR, pending, n)
            return MissReason.STORAGE_ERROR
        try:
            if deadline is None and not pending.done():
                self.stats.count(Event.MISS, MissReason.TIMEOUT, n)   # best_effort: not yet
                return MissReason.TIMEOUT
            left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            return pending.result(left)
        except Exception as e:  # noqa: BLE001
            self.link.fault(req, "get", MissReason.STORAGE_ERROR, e, n)
            return MissReason.STORAGE_ERROR

    def _page_tokens(self, req: Req, chain: Chain, i: int) -> list[int]:
        """The request's own tokens of page ``chain.names[i]``, which the record's name must
        hash from (L3 keeps no tokens)::

            prefix (local hit)  names            page j = len(prefix) + i covers
            n0 n1 n2          | n3 n4 n5          input_ids[j*ps : (j+1)*ps]
        """
        ps = self.link.page_size
        at = (len(chain.prefix) + i) * ps
        return req.input_ids[at:at + ps]

    def _check(self, req: Req, record: PageRecord | None, name: bytes, prior: bytes,
               seed: bytes, tokens: list[int], pool: str) -> MissReason | None:
        if record is None:
            return MissReason.NOT_STORED
        if record.header.seed != seed:
            # NOTE: the audit does not trust the lookup: whatever found this record, another
            # namespace produced it, so it is never served to this request.
            log.error("request %s: L3 record %s was produced in another namespace; refused",
                      req.rid, name.hex())
            return MissReason.CROSS_NAMESPACE
        # NOTE: a backend that checksums the bytes in this very process as it receives them
        # (the sharded client, on the mapped records) has done what a second pass here
        # would: that pass is skipped. Any other backend's records are checksummed again
        # here, end to end. What only this reader can check, the page's tokens, always is.
        problem = verify(record, self.link.layout, self.link.algo, name=name, prior=prior,
                         pool=pool, tokens=tokens,
                         checksums_done=self.link.storage.checksums_in_reader)
        if problem:
            log.warning("request %s: L3 %s record %s does not verify: %s", req.rid, pool,
                        name.hex(), problem)
            self.stats.count(Event.VERIFICATION_FAILED, Tier.STORAGE)
            return MissReason.VERIFICATION_FAILED
        return None

    def _alloc_free(self, n: int, owner: str) -> list[int]:
        return self.host.alloc(min(n, self.host.num_free), owner)


def _kv_answer(pages: Any) -> Answer:
    return {KV_POOL: list(pages)}


def _answer(transfers: Any) -> Answer:
    return {t.pool: list(t.pages or []) for t in transfers}


def _padded(pages: list[Any] | None, n: int) -> list[Any]:
    """``n`` entries: what came, cut or padded with ``None`` (a short answer's misses)."""
    pages = list(pages or [])[:n]
    return pages + [None] * (n - len(pages))


def _missing_reason(pending: Pending[Any], stale: bool) -> MissReason:
    """Why an asked-for record came back as ``None``: a shard fault, a wait that ran out,
    or the store not having it (any more; ``stale``: a page index said it did)."""
    if pending.faults:
        return pending.faults[0].reason
    if not pending.done():
        return MissReason.TIMEOUT
    return MissReason.STALE_INDEX if stale else MissReason.NOT_STORED
