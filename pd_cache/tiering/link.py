"""``StorageLink``: what the read path and the write path share towards one backend.

The call context of every batch (``ExtraInfo``), the hit query (``batch_exists`` batch by
batch), the rule for faults (a storage fault is logged with the request id, counted by
reason, and ends as a miss; it never reaches the request) and the metrics both paths
record (``observe``: pages, bytes and seconds of one request's transfer, by outcome).

``ExtraInfo.prefix_keys`` is ``None`` when ``storage.prefix_keys`` is off, else the names
before the batch, rebuilt per batch as ``prefix = prefix + batch``: a list already handed
to a backend is never mutated.

``held`` remembers the names this worker stored in L3 or read from it (the most recent
``HeldNames.capacity``) and those its queued writes will store, so with no page index a
prefill can still tell decode which of its prompt's pages L3 holds (a prompt whose local hit
another request computed moments ago included), and decode's offload need not ask.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

from pd_cache.core.config import KVLayout, StorageConfig
from pd_cache.core.request import Req
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason, Outcome
from pd_cache.metrics import PDCacheMetrics
from pd_cache.storage.base import ExtraInfo, StorageBackend
from pd_cache.tiering.chain import Chain, batches

log = logging.getLogger("pd_cache.tiering")


class HeldNames:
    """The last ``capacity`` page names this worker saw L3 hold (acknowledged or read), and
    those its writes under way will store (``writing``); thread-safe. A hint: L3 may have
    evicted one since, or refuse a write (a gap costs a recompute)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._names: OrderedDict[bytes, None] = OrderedDict()
        self._writing: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def add(self, names: Sequence[bytes]) -> None:
        with self._lock:
            for name in names:
                self._names[name] = None
                self._names.move_to_end(name)
            while len(self._names) > self.capacity:
                self._names.popitem(last=False)

    def writing(self, names: Sequence[bytes]) -> None:
        """A write of ``names`` is under way: they count as held until ``written``."""
        with self._lock:
            self._writing.update(names)

    def written(self, names: Sequence[bytes]) -> None:
        """The write of ``names`` ended (the pages it stored were ``add``ed first)."""
        with self._lock:
            self._writing.subtract(names)
            for name in names:
                if self._writing[name] <= 0:
                    del self._writing[name]

    def prefix(self, names: Sequence[bytes]) -> int:
        """How many of ``names``, from the first, are held or being written."""
        with self._lock:
            return next((i for i, n in enumerate(names)
                         if n not in self._names and n not in self._writing), len(names))


class StorageLink:
    """One worker's calls to one ``StorageBackend``; ``call_timeout_s`` bounds each wait.

    ``metrics`` (``None``: record nothing) receives every transfer both paths make.
    ``state_every`` is a hybrid layout's ``state_every_pages`` (where the read path looks
    for recurrent states; see ``pd_cache.kv.state``).
    """

    def __init__(self, storage: StorageBackend, config: StorageConfig, layout: KVLayout, *,
                 algo: str, stats: Stats, call_timeout_s: float,
                 metrics: PDCacheMetrics | None = None, state_every: int = 4) -> None:
        if not isinstance(storage, StorageBackend):
            raise ValueError(f"storage: expected a StorageBackend, got {type(storage).__name__}")
        if not isinstance(config, StorageConfig):
            raise ValueError(f"config: expected StorageConfig, got {type(config).__name__}")
        if not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s: expected a number > 0, got {call_timeout_s!r}")
        self.storage, self.config, self.layout = storage, config, layout
        self.page_size, self.algo = layout.page_size, algo
        self.stats, self.call_timeout_s = stats, call_timeout_s
        self.metrics = metrics
        self.has_state, self.state_every = layout.has_state, state_every
        self.page_nbytes = layout.page_nbytes
        self.held = HeldNames()

    def info(self, req: Req, chain: Chain, prefix: list[bytes] | None, *,
             pin: bool = True) -> ExtraInfo:
        """The context of one call; ``pin``: a write of pages the request pins."""
        return ExtraInfo(prefix_keys=prefix, namespace_seed=chain.seed, request_id=req.rid,
                         tenant=req.tenant, pin_ttl_s=(req.pin_ttl_s or None) if pin else None)

    def start_prefix(self, chain: Chain) -> list[bytes] | None:
        """``prefix_keys`` of the chain's first batch (``None``: the feature is off)."""
        return list(chain.prefix) if self.config.prefix_keys else None

    def query(self, req: Req, chain: Chain, *, count: bool = True) -> int:
        """How many of ``chain.names``, from the first, L3 holds (``0`` on a fault).

        ``count``: count the pages L3 lacks as misses (a lookup, not a pre-write check).
        """
        prefix, hits = self.start_prefix(chain), 0
        for batch in batches(chain.names, self.config.batch_pages):
            try:
                found = int(self.storage.submit_exists(batch, self.info(req, chain, prefix))
                            .result(self.call_timeout_s))
            except Exception as e:  # noqa: BLE001 - a cache fault never fails the request
                self.fault(req, "exists", MissReason.STORAGE_ERROR, e, len(chain.names) - hits)
                return 0
            found = max(0, min(found, len(batch)))   # a malformed answer claims nothing more
            hits += found
            if found < len(batch):
                break
            prefix = None if prefix is None else prefix + batch
        if count and hits < len(chain.names):
            self.stats.count(Event.MISS, MissReason.NOT_STORED, len(chain.names) - hits)
        return hits

    def fault(self, req: Req, what: str, reason: MissReason, error: BaseException,
              num_pages: int) -> None:
        """Log a failed call once with the request id and count it (as a miss of
        ``num_pages`` pages, or once when none were at stake)."""
        log.warning("request %s: L3 %s failed (%s: %s); recomputing", req.rid, what,
                    type(error).__name__, str(error)[:200])
        self.stats.count(Event.MISS, reason, num_pages or 1)

    def observe_wait(self, issued: float, started: float) -> None:
        """Record how long a write issued at ``issued`` waited until ``started`` (both
        ``time.perf_counter()``) for the write thread."""
        if self.metrics is not None:
            self.metrics.observe_backup_wait(max(0.0, started - issued),
                                             backend=self.config.backend)

    def observe(self, what: str, pages: int, wanted: int, started: float) -> None:
        """Record one request's ``what`` (prefetch | backup) that moved ``pages`` of the
        ``wanted`` it tried, begun at ``started`` (``time.perf_counter()``)."""
        if self.metrics is None or not wanted:
            return
        outcome = Outcome.OK if pages == wanted else Outcome.SHORT if pages else Outcome.FAILED
        record = self.metrics.observe_prefetch if what == "prefetch" \
            else self.metrics.observe_backup
        record(pages, pages * self.page_nbytes, time.perf_counter() - started,
               backend=self.config.backend, outcome=outcome.value)
