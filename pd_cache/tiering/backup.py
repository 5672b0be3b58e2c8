"""The write path: new full pages -> L3 ``batch_set``, on one background thread, in order.

Records and checksums are built on that thread, off the request path; ``flush`` waits for
what was issued so far. The thread is lowered to ``StorageConfig.write_nice`` (Linux: its
own nice value), never raised: below the forwards and decode steps it takes the cores they
leave idle. A Ray worker's threads already run at nice 15 (``RAY_worker_niceness``), which
the default (10) leaves as it is. A failed batch stops that write (the pages after it would not
chain from a stored page) and is counted; it never takes the worker down.

Every batch is one ``batch_set_v2``. A hybrid model's write also carries the recurrent
states of its checkpoint pages: batches end at those pages, and each such batch stores,
beside the KV of its pages, the ``state`` of its last page as a trailing sidecar::

    pages   0  1  2  3 | 4  5  6  7 | 8  9        checkpoints 3, 7, 9
    kv      x  x  x  x | x  x  x  x | x  x
    state            x |          x |    x
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from pd_cache.core.request import Req
from pd_cache.core.vocab import BACKUP, FAILED_BATCH, PAGE, STATE, MissReason
from pd_cache.storage.base import PoolTransfer
from pd_cache.storage.record import KV_POOL, STATE_POOL, PageRecord, make_record
from pd_cache.tiering.chain import Chain, runs
from pd_cache.tiering.link import StorageLink

log = logging.getLogger("pd_cache.tiering")


def lower_thread_priority(nice: int) -> None:
    """Run the calling thread at nice value ``nice`` if that is lower in priority than it
    runs now (never higher). Linux only, where each thread has a nice value of its own;
    best effort: where it cannot be set, the thread keeps its priority."""
    if not sys.platform.startswith("linux"):
        return
    # NOTE: on Linux PRIO_PROCESS with a thread's id sets that thread alone (setpriority(2)).
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:
        log.debug("the L3 write thread keeps its priority: %s", e)


class BackupWriter:
    """Writes pages of a request's chain to L3 later, in issue order."""

    def __init__(self, link: StorageLink) -> None:
        self.link, self.stats = link, link.stats
        self._writer = ThreadPoolExecutor(
            1, thread_name_prefix="pd-cache-backup",
            initializer=functools.partial(lower_thread_priority, link.config.write_nice))
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def backup(self, req: Req, names: Sequence[bytes], tokens: Sequence[int],
               pages: torch.Tensor, prefix: Sequence[bytes] = (), *, skip_stored: bool = False,
               kind: str = BACKUP, page_kinds: Sequence[str] | None = None,
               copy: bool = True, states: Mapping[int, torch.Tensor] | None = None,
               pinned: int | None = None) -> Future[None]:
        """Write pages ``names`` (KV ``pages[i]``, ``tokens`` of all of them) to L3 later.

        ``prefix`` names the chain's pages before ``names``. With ``skip_stored`` the pages
        L3 already holds (its hit prefix) are not sent again. Stored pages are counted as
        ``kind/page``, and also as ``kind/<page_kinds[i]>`` when given, one per page of
        ``names`` (the offload manager's ``prompt`` / ``generated``).
        Returns at once; the write runs on the background thread; ``flush`` waits for it.

        The pages are snapshotted before this returns, so the caller may change or reuse
        its tensor at once; ``copy=False`` is for a caller that hands over a tensor it
        made for this call and never touches again.

        ``states`` (hybrid models) maps an index of ``names`` to the recurrent state after
        that page: the write's checkpoints, each stored with the batch it ends. They are
        always copied (a decoding state changes in place).

        ``pinned``: how many of ``names``, from the first, carry the request's pin (its
        prompt's pages; ``None``: all of them). Batches end where they stop, so no page
        past them is stored pinned.
        """
        names, tokens = list(names), list(tokens)
        ps = self.link.page_size
        if len(tokens) != len(names) * ps or pages.shape[0] < len(names):
            raise ValueError(f"backup: {len(names)} names, {len(tokens)} tokens and "
                             f"{pages.shape[0]} pages do not match (page_size {ps})")
        kinds = None if page_kinds is None else list(page_kinds)
        if kinds is not None and len(kinds) != len(names):
            raise ValueError(f"backup: {len(kinds)} page kinds for {len(names)} names")
        chain = Chain.of(req, names, prefix, algo=self.link.algo)
        snapshot = pages.detach().to("cpu", copy=copy)
        kept = {i: s.detach().to("cpu", copy=True) for i, s in (states or {}).items()
                if 0 <= i < len(names)}
        # NOTE: from now on this worker vouches for these pages (``held_after``): a request
        # whose local hit they are tells decode's offload not to write them again.
        self.link.held.writing(chain.names)
        try:
            job = self._writer.submit(self._write, req, chain, tokens, snapshot, kept,
                                      skip_stored, kind, kinds, pinned, time.perf_counter())
        except BaseException:
            self.link.held.written(chain.names)
            raise
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [job]
        return job

    def _write(self, req: Req, chain: Chain, tokens: list[int], pages: torch.Tensor,
               states: dict[int, torch.Tensor], skip_stored: bool, kind: str,
               kinds: list[str] | None, pinned: int | None, issued: float) -> None:
        started, start, stored = time.perf_counter(), len(chain.names), 0
        self.link.observe_wait(issued, started)
        pinned = len(chain.names) if pinned is None or not req.pin_ttl_s else pinned
        try:
            start = self.link.query(req, chain, count=False) if skip_stored else 0
            prefix = self.link.start_prefix(chain)
            prefix = None if prefix is None else prefix + chain.names[:start]
            ends = {i - start for i in [*states, pinned - 1] if i >= start}
            for run in runs(len(chain.names) - start, self.link.config.batch_pages, ends):
                lo, hi = start + run.start, start + run.stop
                batch = chain.names[lo:hi]
                done = self._write_batch(req, chain, lo, batch, tokens, pages, prefix, kind,
                                         kinds, states.get(hi - 1), pin=hi <= pinned)
                stored += done
                if done < len(batch):
                    break
                prefix = None if prefix is None else prefix + batch
        except Exception:  # noqa: BLE001 - a background write never takes the worker down
            log.exception("request %s: L3 %s failed", req.rid, kind)
            self.stats.count(kind, FAILED_BATCH)
        finally:
            self.link.held.written(chain.names)
        self.link.observe("backup", stored, len(chain.names) - start, started)

    def _write_batch(self, req: Req, chain: Chain, lo: int, batch: list[bytes],
                     tokens: list[int], pages: torch.Tensor, prefix: list[bytes] | None,
                     kind: str, kinds: list[str] | None,
                     state: torch.Tensor | None, *, pin: bool) -> int:
        """Store one batch (and the state of its last page, when given; pinned with
        ``pin``); how many of its pages, from the first, L3 acknowledged."""
        link = self.link
        records = [self._record(chain, lo + i, tokens, {KV_POOL: pages[lo + i]})
                   for i in range(len(batch))]
        transfers = [PoolTransfer(KV_POOL, batch, records)]
        if state is not None:
            last = self._record(chain, lo + len(batch) - 1, tokens, {STATE_POOL: state})
            transfers.append(PoolTransfer(STATE_POOL, batch[-1:], [last]))
        try:
            acks, *state_acks = link.storage.submit_set_v2(
                transfers, link.info(req, chain, prefix, pin=pin)).result(link.call_timeout_s)
            if state_acks and all(acks) and list(state_acks[0]) == [True]:
                self.stats.count(kind, STATE)
        except Exception as e:  # noqa: BLE001
            link.fault(req, kind, MissReason.STORAGE_ERROR, e, 0)
            acks = []
        stored = next((i for i, ok in enumerate(acks) if not ok), len(acks))
        if stored:
            link.held.add(batch[:stored])
            self.stats.count(kind, PAGE, stored)
            for page, n in Counter((kinds or [])[lo:lo + stored]).items():
                self.stats.count(kind, page, n)
                if link.metrics is not None:
                    link.metrics.count_offload(page, n)
        if stored < len(batch):
            log.warning("request %s: L3 %s batch stored %d of %d pages; stopping", req.rid,
                        kind, stored, len(batch))
            self.stats.count(kind, FAILED_BATCH)
        return stored

    def _record(self, chain: Chain, i: int, tokens: list[int],
                pools: dict[str, torch.Tensor]) -> PageRecord:
        """The record of page ``chain.names[i]`` holding ``pools``."""
        ps, link = self.link.page_size, self.link
        return make_record(chain.names[i], chain.prior(i), tokens[i * ps:(i + 1) * ps], pools,
                           fingerprint=link.layout.fingerprint, algo=link.algo,
                           seed=chain.seed, sums=not link.storage.seals)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every backup issued so far; ``False`` if some are still running."""
        with self._lock:
            jobs = list(self._pending)
        _, running = wait_futures(jobs, timeout=timeout)
        return not running

    def close(self) -> None:
        """Finish the queued backups and stop the background thread."""
        self._writer.shutdown(wait=True)
