"""``CacheController``: between a worker's host pool (L2) and the L3 storage tier.

    query     the request's page names past its local hit  -> batch_exists, per batch
    prefetch  the hit pages -> host slots, batch by batch: submit_get, verify, land, ack
    backup    new full pages -> batch_set on a background thread (off the request path)

Every call carries ``ExtraInfo.prefix_keys`` (``None`` when ``storage.prefix_keys`` is off,
else the names before the batch), rebuilt per batch as ``prefix = prefix + batch``: a list
already handed to a backend is never mutated. A storage fault (a raise, a timeout, a bad
record, a chain that is not the request's) never fails the request: the pages it would have
supplied are recomputed, and the fault is counted in ``stats`` by reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import torch

from pd_cache.config import StorageConfig
from pd_cache.hashing import compute_prefix_hash, namespace_seed
from pd_cache.kv.pool import PagePool
from pd_cache.request import Req
from pd_cache.stats import Event, MissReason, Stats
from pd_cache.storage.base import ExtraInfo, Pending, StorageBackend
from pd_cache.storage.record import KV_POOL, PageRecord, make_record, verify

log = logging.getLogger(__name__)

STORAGE = "storage"             # reason of ``hit`` for pages served from L3
PREFETCH_BATCH = "prefetch_batch"
PREFETCH_ACK = "prefetch_ack"   # reasons: ok | short
BACKUP = "backup"               # reasons: page | failed_batch
OFFLOAD = "offload"             # the decode side's backups, same reasons

Alloc = Callable[[int, str], list[int]]


class Chain(NamedTuple):
    """A run of page names and where it sits in its request's chain."""

    names: list[bytes]
    prefix: list[bytes]   # the chain's names before ``names`` (from the namespace seed)
    seed: bytes

    def prior(self, i: int) -> bytes:
        """The name page ``names[i]`` hashes from."""
        if i > 0:
            return self.names[i - 1]
        return self.prefix[-1] if self.prefix else self.seed


class Prefetched:
    """Pages a prefetch landed in host slots, in chain order; ``release`` frees the slots."""

    def __init__(self, pool: PagePool, slots: list[int], owner: str) -> None:
        self.pool, self.slots, self.owner = pool, slots, owner

    @property
    def num_pages(self) -> int:
        return len(self.slots)

    def read(self) -> torch.Tensor:
        """A copy of the landed pages, ``[num_pages, *page_shape]``."""
        return self.pool.read(self.slots)

    def release(self) -> None:
        """Free the slots (the pool raises ``SlotError`` if called twice)."""
        self.pool.free(self.slots, self.owner)


class CacheController:
    """Prefetch from and write through to one ``StorageBackend`` for one worker.

    ``alloc(n, owner)`` hands out up to ``n`` host slots (the engine evicts L2 pages to
    make room); prefetched pages land there. ``call_timeout_s`` bounds every wait on an
    asynchronous backend (``wait_complete`` included); in-process backends answer at once.
    Prefetch runs on the caller's thread; backups run on one background thread, in order.
    """

    def __init__(self, storage: StorageBackend, host_pool: PagePool, config: StorageConfig,
                 *, algo: str = "xxh3_128", stats: Stats | None = None,
                 alloc: Alloc | None = None, call_timeout_s: float = 30.0) -> None:
        if not isinstance(storage, StorageBackend):
            raise ValueError(f"storage: expected a StorageBackend, got {type(storage).__name__}")
        if not isinstance(config, StorageConfig):
            raise ValueError(f"config: expected StorageConfig, got {type(config).__name__}")
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s: expected a number > 0, got {call_timeout_s!r}")
        self.storage, self.host, self.config, self.algo = storage, host_pool, config, algo
        self.layout = host_pool.layout
        self.page_size = self.layout.page_size
        self.stats = stats if stats is not None else Stats()
        self._alloc = alloc if alloc is not None else self._alloc_free
        self.call_timeout_s = call_timeout_s
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pd-cache-backup")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    # -- naming -----------------------------------------------------------------------------

    def locate(self, req: Req, names: Sequence[bytes]) -> Chain | None:
        """``names`` placed in the chain of ``req``'s prompt, or ``None`` if they are not
        a run of it (computed in another namespace, or for other tokens)."""
        seed = namespace_seed(req.extra_key, req.cache_salt, self.algo)
        names = list(names)
        if not names:
            return Chain([], [], seed)
        full = compute_prefix_hash(req, req.input_ids, page_size=self.page_size,
                                   algo=self.algo)
        try:
            start = full.index(names[0])
        except ValueError:
            return None
        if full[start:start + len(names)] != names:
            return None
        return Chain(names, full[:start], seed)

    def _info(self, req: Req, chain: Chain, prefix: list[bytes] | None) -> ExtraInfo:
        return ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed, request_id=req.rid)

    def _start_prefix(self, chain: Chain) -> list[bytes] | None:
        return list(chain.prefix) if self.config.prefix_keys else None

    # -- storage hit query ------------------------------------------------------------------

    def query(self, req: Req, chain: Chain, *, count: bool = True) -> int:
        """How many of ``chain.names``, from the first, L3 holds (``0`` on a fault).

        ``count``: count the pages L3 lacks as misses (a lookup, not a pre-write check).
        """
        prefix, hits = self._start_prefix(chain), 0
        for batch in _batches(chain.names, self.config.batch_pages):
            try:
                found = self.storage.submit_exists(batch, self._info(req, chain, prefix)) \
                    .result(self.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - a cache fault never fails the request
                self._fault(req, "exists", MissReason.STORAGE_ERROR, e, len(chain.names) - hits)
                return 0
            hits += min(int(found), len(batch))
            if found < len(batch):
                break
            prefix = None if prefix is None else prefix + batch
        if count and hits < len(chain.names):
            self.stats.count(Event.MISS, MissReason.NOT_STORED, len(chain.names) - hits)
        return hits

    # -- prefetch ---------------------------------------------------------------------------

    def prefetch(self, req: Req, names: Sequence[bytes],
                 policy: str | None = None) -> Prefetched:
        """Load the leading pages of ``names`` that L3 holds into host slots.

        ``names`` are the prompt's page names right after its local hit. Returns the pages
        that landed, verified, in order; the caller reads them and calls ``release``.
        Slots for pages that did not land are freed here, once.
        """
        owner = f"prefetch:{req.rid}"
        chain = self.locate(req, names)
        if chain is None:
            log.error("request %s: refusing an L3 prefetch whose page names are not in the "
                      "request's namespace chain; recomputing", req.rid)
            self.stats.count(Event.MISS, MissReason.NAMESPACE_REFUSED, len(names))
            return Prefetched(self.host, [], owner)
        hits = self.query(req, chain) if chain.names else 0
        slots = self._alloc(hits, owner) if hits else []
        landed = self._load(req, chain._replace(names=chain.names[:len(slots)]), slots,
                            policy or self.config.prefetch_policy)
        self.host.free(slots[landed:], owner)
        if landed:
            self.stats.count(Event.HIT, STORAGE, landed)
        return Prefetched(self.host, slots[:landed], owner)

    def deadline(self, policy: str, num_tokens: int) -> float | None:
        """When the policy stops waiting (``time.monotonic()`` scale); ``None``: no wait."""
        if policy == "best_effort":
            return None
        if policy == "wait_complete":
            return time.monotonic() + self.call_timeout_s
        c = self.config
        bound = c.prefetch_timeout_base_s + c.prefetch_timeout_per_1k_tokens_s * num_tokens / 1e3
        return time.monotonic() + min(bound, c.prefetch_timeout_max_s)

    def _load(self, req: Req, chain: Chain, slots: list[int], policy: str) -> int:
        """Submit every batch, then land them in order; one ack per batch issued."""
        batches = _batches(chain.names, self.config.batch_pages)
        prefix, issued = self._start_prefix(chain), []
        for batch in batches:
            issued.append(self._submit_get(batch, self._info(req, chain, prefix)))
            self.stats.count(PREFETCH_BATCH)
            prefix = None if prefix is None else prefix + batch
        deadline = self.deadline(policy, len(chain.names) * self.page_size)
        landed, going = 0, True
        for batch, pending in zip(batches, issued):
            got = self._land(req, chain, landed, batch, pending, slots, deadline) if going else 0
            self.stats.count(PREFETCH_ACK, "ok" if got == len(batch) else "short")
            landed += got
            going = going and got == len(batch)
        return landed

    def _submit_get(self, batch: list[bytes], info: ExtraInfo) -> Pending[Any] | Exception:
        try:
            return self.storage.submit_get(batch, info)
        except Exception as e:  # noqa: BLE001 - counted when the batch is landed
            return e

    def _land(self, req: Req, chain: Chain, start: int, batch: list[bytes],
              pending: Pending[Any] | Exception, slots: list[int],
              deadline: float | None) -> int:
        """Verify one batch's records and copy the leading good ones to their slots."""
        records = self._wait(req, pending, deadline, len(batch))
        if records is None:
            return 0
        records = records[:len(batch)] + [None] * (len(batch) - len(records))  # short: misses
        good: list[torch.Tensor] = []
        for i, (name, record) in enumerate(zip(batch, records)):
            reason = self._check(req, record, name, chain.prior(start + i))
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
            self._fault(req, "get", MissReason.STORAGE_ERROR, pending, n)
            return None
        try:
            if deadline is None and not pending.done():
                self.stats.count(Event.MISS, MissReason.TIMEOUT, n)   # best_effort: not yet
                return None
            left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            return list(pending.result(left))
        except Exception as e:  # noqa: BLE001
            self._fault(req, "get", MissReason.STORAGE_ERROR, e, n)
            return None

    def _check(self, req: Req, record: PageRecord | None, name: bytes,
               prior: bytes) -> MissReason | None:
        if record is None:
            return MissReason.NOT_STORED
        problem = verify(record, self.layout, self.algo, name=name, prior=prior, pool=KV_POOL)
        if problem:
            log.warning("request %s: L3 record %s does not verify: %s", req.rid, name.hex(),
                        problem)
            self.stats.count(Event.VERIFICATION_FAILED, STORAGE)
            return MissReason.VERIFICATION_FAILED
        return None

    # -- backup -----------------------------------------------------------------------------

    def backup(self, req: Req, names: Sequence[bytes], tokens: Sequence[int],
               pages: torch.Tensor, prefix: Sequence[bytes] = (), *, skip_stored: bool = False,
               kind: str = BACKUP, page_kind: str | None = None) -> Future[None]:
        """Write pages ``names`` (KV ``pages[i]``, ``tokens`` of all of them) to L3 later.

        ``prefix`` names the chain's pages before ``names``. With ``skip_stored`` the pages
        L3 already holds (its hit prefix) are not sent again. Stored pages are counted as
        ``kind/page``, and also as ``kind/<page_kind>`` when given (the offload manager's
        ``prompt`` / ``generated``). Returns at once; the write runs on the background
        thread; ``flush`` waits for it.
        """
        names, tokens = list(names), list(tokens)
        if len(tokens) != len(names) * self.page_size or pages.shape[0] < len(names):
            raise ValueError(f"backup: {len(names)} names, {len(tokens)} tokens and "
                             f"{pages.shape[0]} pages do not match (page_size "
                             f"{self.page_size})")
        seed = namespace_seed(req.extra_key, req.cache_salt, self.algo)
        chain = Chain(names, list(prefix), seed)
        job = self._writer.submit(self._write, req, chain, tokens, pages.detach().cpu(),
                                  skip_stored, kind, page_kind)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [job]
        return job

    def _write(self, req: Req, chain: Chain, tokens: list[int], pages: torch.Tensor,
               skip_stored: bool, kind: str, page_kind: str | None) -> None:
        try:
            start = self.query(req, chain, count=False) if skip_stored else 0
            prefix = self._start_prefix(chain)
            prefix = None if prefix is None else prefix + chain.names[:start]
            for lo in range(start, len(chain.names), self.config.batch_pages):
                batch = chain.names[lo:lo + self.config.batch_pages]
                if not self._write_batch(req, chain, lo, batch, tokens, pages, prefix, kind,
                                         page_kind):
                    return
                prefix = None if prefix is None else prefix + batch
        except Exception:  # noqa: BLE001 - a background write never takes the worker down
            log.exception("request %s: L3 %s failed", req.rid, kind)
            self.stats.count(kind, "failed_batch")

    def _write_batch(self, req: Req, chain: Chain, lo: int, batch: list[bytes],
                     tokens: list[int], pages: torch.Tensor, prefix: list[bytes] | None,
                     kind: str, page_kind: str | None) -> bool:
        ps = self.page_size
        records = [make_record(name, chain.prior(lo + i),
                               tokens[(lo + i) * ps:(lo + i + 1) * ps],
                               {KV_POOL: pages[lo + i]}, fingerprint=self.layout.fingerprint,
                               algo=self.algo)
                   for i, name in enumerate(batch)]
        try:
            acks = self.storage.submit_set(batch, records, self._info(req, chain, prefix)) \
                .result(self.call_timeout_s)
        except Exception as e:  # noqa: BLE001
            self._fault(req, kind, MissReason.STORAGE_ERROR, e, 0)
            acks = []
        stored = next((i for i, ok in enumerate(acks) if not ok), len(acks))
        if stored:
            self.stats.count(kind, "page", stored)
            if page_kind is not None:
                self.stats.count(kind, page_kind, stored)
        if stored < len(batch):
            log.warning("request %s: L3 %s batch stored %d of %d pages; stopping", req.rid,
                        kind, stored, len(batch))
            self.stats.count(kind, "failed_batch")
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every backup issued so far; ``False`` if some are still running."""
        with self._lock:
            jobs = list(self._pending)
        _, running = wait_futures(jobs, timeout=timeout)
        return not running

    def close(self) -> None:
        """Finish the queued backups and stop the background thread."""
        self._writer.shutdown(wait=True)

    # -- helpers ----------------------------------------------------------------------------

    def _alloc_free(self, n: int, owner: str) -> list[int]:
        return self.host.alloc(min(n, self.host.num_free), owner)

    def _fault(self, req: Req, what: str, reason: MissReason, error: BaseException,
               num_pages: int) -> None:
        log.warning("request %s: L3 %s failed (%s: %s); recomputing", req.rid, what,
                    type(error).__name__, str(error)[:200])
        if num_pages:
            self.stats.count(Event.MISS, reason, num_pages)
        else:
            self.stats.count(Event.MISS, reason)


def _missing_reason(pending: Pending[Any]) -> MissReason:
    """Why an asked-for record came back as ``None``: a shard fault, a wait that ran out
    (the call is still not done), or the store not having it (any more)."""
    if pending.faults:
        return pending.faults[0].reason
    return MissReason.NOT_STORED if pending.done() else MissReason.TIMEOUT


def _batches(names: list[bytes], size: int) -> list[list[bytes]]:
    return [names[i:i + size] for i in range(0, len(names), size)]
