"""The read path: L3 -> host slots, verified, batch by batch.

    query     the chain's names past the local hit  -> batch_exists, per batch
    prefetch  the hit pages -> host slots: submit every get, then land each batch in
              order (wait by policy, verify, copy), one ack per batch issued

A page that does not arrive in time, does not verify, or is missing ends the prefetch
there: the pages after it are recomputed. Slots for pages that did not land are freed
here, exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pd_cache.core.request import Req
from pd_cache.core.vocab import PREFETCH_ACK, PREFETCH_BATCH, Event, MissReason, Tier
from pd_cache.kv.pool import PagePool
from pd_cache.storage.base import Pending
from pd_cache.storage.record import KV_POOL, PageRecord, verify
from pd_cache.tiering.chain import Chain, batches
from pd_cache.tiering.link import StorageLink

log = logging.getLogger("pd_cache.tiering")

Alloc = Callable[[int, str], list[int]]


class Prefetched:
    """Pages a prefetch landed in host slots, in chain order; ``release`` frees the slots.

    ``cross_namespace`` counts records refused because another namespace produced them.
    """

    def __init__(self, pool: PagePool, slots: list[int], owner: str,
                 cross_namespace: int = 0) -> None:
        self.pool, self.slots, self.owner = pool, slots, owner
        self.cross_namespace = cross_namespace

    @property
    def num_pages(self) -> int:
        return len(self.slots)

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
                 policy: str | None = None) -> Prefetched:
        """Load the leading pages of ``names`` (after ``prefix``) that L3 holds.

        ``names`` are the prompt's page names right after its local hit, ``prefix`` the
        names before them, both in ``req``'s namespace as the caller computed them.
        Returns the pages that landed, verified, in order; the caller reads them and calls
        ``release``.
        """
        owner, started = f"prefetch:{req.rid}", time.perf_counter()
        chain = Chain.of(req, names, prefix, algo=self.link.algo)
        hits = self.link.query(req, chain) if chain.names else 0
        slots = self._alloc(hits, owner) if hits else []
        refused: list[bytes] = []
        try:
            landed = self._load(req, chain._replace(names=chain.names[:len(slots)]), slots,
                                policy or self.config.prefetch_policy, refused)
        except Exception as e:  # noqa: BLE001 - a malformed answer is a miss, never a failure
            self.link.fault(req, "prefetch", MissReason.STORAGE_ERROR, e, len(slots))
            landed = 0
        self.host.free(slots[landed:], owner)
        if landed:
            self.stats.count(Event.HIT, Tier.STORAGE, landed)
        self.link.observe("prefetch", landed, hits, started)
        return Prefetched(self.host, slots[:landed], owner, len(refused))

    def deadline(self, policy: str, num_tokens: int) -> float | None:
        """When the policy stops waiting (``time.monotonic()`` scale); ``None``: no wait."""
        if policy == "best_effort":
            return None
        if policy == "wait_complete":
            return time.monotonic() + self.link.call_timeout_s
        c = self.config
        bound = c.prefetch_timeout_base_s + c.prefetch_timeout_per_1k_tokens_s * num_tokens / 1e3
        return time.monotonic() + min(bound, c.prefetch_timeout_max_s)

    def _load(self, req: Req, chain: Chain, slots: list[int], policy: str,
              refused: list[bytes]) -> int:
        """Submit every batch, then land them in order; one ack per batch issued.
        Names of records another namespace produced are added to ``refused``."""
        runs = batches(chain.names, self.config.batch_pages)
        prefix, issued = self.link.start_prefix(chain), []
        for batch in runs:
            issued.append(self._submit_get(batch, self.link.info(req, chain, prefix)))
            self.stats.count(PREFETCH_BATCH)
            prefix = None if prefix is None else prefix + batch
        deadline = self.deadline(policy, len(chain.names) * self.link.page_size)
        landed, going = 0, True
        for batch, pending in zip(runs, issued):
            got = (self._land(req, chain, landed, batch, pending, slots, deadline, refused)
                   if going else 0)
            self.stats.count(PREFETCH_ACK, "ok" if got == len(batch) else "short")
            landed += got
            going = going and got == len(batch)
        return landed

    def _submit_get(self, batch: list[bytes], info: Any) -> Pending[Any] | Exception:
        try:
            return self.link.storage.submit_get(batch, info)
        except Exception as e:  # noqa: BLE001 - counted when the batch is landed
            return e

    def _land(self, req: Req, chain: Chain, start: int, batch: list[bytes],
              pending: Pending[Any] | Exception, slots: list[int],
              deadline: float | None, refused: list[bytes]) -> int:
        """Verify one batch's records and copy the leading good ones to their slots."""
        records = self._wait(req, pending, deadline, len(batch))
        if records is None:
            return 0
        records = records[:len(batch)] + [None] * (len(batch) - len(records))  # short: misses
        good: list[torch.Tensor] = []
        for i, (name, record) in enumerate(zip(batch, records)):
            reason = self._check(req, record, name, chain.prior(start + i), chain.seed,
                                 self._page_tokens(req, chain, start + i))
            if reason is MissReason.CROSS_NAMESPACE:
                refused.extend(batch[i:])   # counted like every miss: the pages it costs
            if reason is not None:
                if record is None and isinstance(pending, Pending):
                    reason = _missing_reason(pending)
                self.stats.count(Event.MISS, reason, len(batch) - i)
                break
            good.append(record.payload(KV_POOL))
        if good:
            self.host.write(slots[start:start + len(good)], torch.stack(good))
        return len(good)

    def _wait(self, req: Req, pending: Pending[Any] | Exception, deadline: float | None,
              n: int) -> list[PageRecord | None] | None:
        if isinstance(pending, Exception):
            self.link.fault(req, "get", MissReason.STORAGE_ERROR, pending, n)
            return None
        try:
            if deadline is None and not pending.done():
                self.stats.count(Event.MISS, MissReason.TIMEOUT, n)   # best_effort: not yet
                return None
            left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            return list(pending.result(left))
        except Exception as e:  # noqa: BLE001
            self.link.fault(req, "get", MissReason.STORAGE_ERROR, e, n)
            return None

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
               seed: bytes, tokens: list[int]) -> MissReason | None:
        if record is None:
            return MissReason.NOT_STORED
        if record.header.seed != seed:
            # NOTE: the audit does not trust the lookup: whatever found this record, another
            # namespace produced it, so it is never served to this request.
            log.error("request %s: L3 record %s was produced in another namespace; refused",
                      req.rid, name.hex())
            return MissReason.CROSS_NAMESPACE
        problem = verify(record, self.link.layout, self.link.algo, name=name, prior=prior,
                         pool=KV_POOL, tokens=tokens)
        if problem:
            log.warning("request %s: L3 record %s does not verify: %s", req.rid, name.hex(),
                        problem)
            self.stats.count(Event.VERIFICATION_FAILED, Tier.STORAGE)
            return MissReason.VERIFICATION_FAILED
        return None

    def _alloc_free(self, n: int, owner: str) -> list[int]:
        return self.host.alloc(min(n, self.host.num_free), owner)


def _missing_reason(pending: Pending[Any]) -> MissReason:
    """Why an asked-for record came back as ``None``: a shard fault, a wait that ran out
    (the call is still not done), or the store not having it (any more)."""
    if pending.faults:
        return pending.faults[0].reason
    return MissReason.NOT_STORED if pending.done() else MissReason.TIMEOUT
