"""The write path: new full pages -> L3 ``batch_set``, on one background thread, in order.

Records and checksums are built on that thread, off the request path; ``flush`` waits for
what was issued so far. A failed batch stops that write (the pages after it would not
chain from a stored page) and is counted; it never takes the worker down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from pd_cache.core.request import Req
from pd_cache.core.vocab import BACKUP, FAILED_BATCH, PAGE, MissReason
from pd_cache.storage.record import KV_POOL, make_record
from pd_cache.tiering.chain import Chain
from pd_cache.tiering.link import StorageLink

log = logging.getLogger("pd_cache.tiering")


class BackupWriter:
    """Writes pages of a request's chain to L3 later, in issue order."""

    def __init__(self, link: StorageLink) -> None:
        self.link, self.stats = link, link.stats
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pd-cache-backup")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def backup(self, req: Req, names: Sequence[bytes], tokens: Sequence[int],
               pages: torch.Tensor, prefix: Sequence[bytes] = (), *, skip_stored: bool = False,
               kind: str = BACKUP, page_kind: str | None = None,
               copy: bool = True) -> Future[None]:
        """Write pages ``names`` (KV ``pages[i]``, ``tokens`` of all of them) to L3 later.

        ``prefix`` names the chain's pages before ``names``. With ``skip_stored`` the pages
        L3 already holds (its hit prefix) are not sent again. Stored pages are counted as
        ``kind/page``, and also as ``kind/<page_kind>`` when given (the offload manager's
        ``prompt`` / ``generated``). Returns at once; the write runs on the background
        thread; ``flush`` waits for it.

        The pages are snapshotted before this returns, so the caller may change or reuse
        its tensor at once; ``copy=False`` is for a caller that hands over a tensor it
        made for this call and never touches again.
        """
        names, tokens = list(names), list(tokens)
        ps = self.link.page_size
        if len(tokens) != len(names) * ps or pages.shape[0] < len(names):
            raise ValueError(f"backup: {len(names)} names, {len(tokens)} tokens and "
                             f"{pages.shape[0]} pages do not match (page_size {ps})")
        chain = Chain.of(req, names, prefix, algo=self.link.algo)
        snapshot = pages.detach().to("cpu", copy=copy)
        job = self._writer.submit(self._write, req, chain, tokens, snapshot, skip_stored, kind,
                                  page_kind)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [job]
        return job

    def _write(self, req: Req, chain: Chain, tokens: list[int], pages: torch.Tensor,
               skip_stored: bool, kind: str, page_kind: str | None) -> None:
        started, start, stored = time.perf_counter(), len(chain.names), 0
        try:
            start = self.link.query(req, chain, count=False) if skip_stored else 0
            prefix = self.link.start_prefix(chain)
            prefix = None if prefix is None else prefix + chain.names[:start]
            size = self.link.config.batch_pages
            for lo in range(start, len(chain.names), size):
                batch = chain.names[lo:lo + size]
                done = self._write_batch(req, chain, lo, batch, tokens, pages, prefix, kind,
                                         page_kind)
                stored += done
                if done < len(batch):
                    break
                prefix = None if prefix is None else prefix + batch
        except Exception:  # noqa: BLE001 - a background write never takes the worker down
            log.exception("request %s: L3 %s failed", req.rid, kind)
            self.stats.count(kind, FAILED_BATCH)
        self.link.observe("backup", stored, len(chain.names) - start, started)

    def _write_batch(self, req: Req, chain: Chain, lo: int, batch: list[bytes],
                     tokens: list[int], pages: torch.Tensor, prefix: list[bytes] | None,
                     kind: str, page_kind: str | None) -> int:
        """Store one batch; how many of its pages, from the first, L3 acknowledged."""
        link, ps = self.link, self.link.page_size
        records = [make_record(name, chain.prior(lo + i),
                               tokens[(lo + i) * ps:(lo + i + 1) * ps],
                               {KV_POOL: pages[lo + i]}, fingerprint=link.layout.fingerprint,
                               algo=link.algo, seed=chain.seed)
                   for i, name in enumerate(batch)]
        try:
            acks = link.storage.submit_set(batch, records, link.info(req, chain, prefix)) \
                .result(link.call_timeout_s)
        except Exception as e:  # noqa: BLE001
            link.fault(req, kind, MissReason.STORAGE_ERROR, e, 0)
            acks = []
        stored = next((i for i, ok in enumerate(acks) if not ok), len(acks))
        if stored:
            self.stats.count(kind, PAGE, stored)
            if page_kind is not None:
                self.stats.count(kind, page_kind, stored)
                if link.metrics is not None:
                    link.metrics.count_offload(page_kind, stored)
        if stored < len(batch):
            log.warning("request %s: L3 %s batch stored %d of %d pages; stopping", req.rid,
                        kind, stored, len(batch))
            self.stats.count(kind, FAILED_BATCH)
        return stored

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every backup issued so far; ``False`` if some are still running."""
        with self._lock:
            jobs = list(self._pending)
        _, running = wait_futures(jobs, timeout=timeout)
        return not running

    def close(self) -> None:
        """Finish the queued backups and stop the background thread."""
        self._writer.shutdown(wait=True)
