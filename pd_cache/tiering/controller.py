"""``CacheController``: one worker's link between its host pool (L2) and L3.

What a prefill takes from L3 and gives it, over one ``StorageLink`` shared by both paths::

    fetch          L3 -> host slots, verified -> the pages a prefill resumes from
                   (Prefetcher, on the caller's thread; the slots are freed before it returns)
    write_through  a prefill's new full pages -> L3 (BackupWriter, on its background thread)

Decode's offload writes through the same ``writer``. Both paths take the request's page
names as the worker computed them, with the names before them (``prefix``); neither hashes
a prompt again. A storage fault (a raise, a timeout, a bad record) never fails the request:
the pages it would have supplied are recomputed, and the fault is counted in ``stats`` by
reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from pd_cache.core.config import StorageConfig
from pd_cache.core.request import Req
from pd_cache.core.stats import Stats
from pd_cache.kv.base import CacheKey
from pd_cache.kv.pool import PagePool
from pd_cache.metrics import PDCacheMetrics
from pd_cache.storage.base import StorageBackend
from pd_cache.tiering.backup import BackupWriter
from pd_cache.tiering.link import StorageLink
from pd_cache.tiering.prefetch import Alloc, Prefetcher


class StoredPages(NamedTuple):
    """What L3 supplied: ``pages`` for the leading names, and the pages it offered that
    another namespace had produced (refused). For a hybrid model ``pages`` end at a page
    with a state, and ``states[i]`` is the state after page ``i`` (the last one at least).
    ``stale``: a page the page index said L3 held was not there (its count is not to be
    trusted for writes)."""

    pages: torch.Tensor
    cross_namespace: int = 0
    states: dict[int, torch.Tensor] | None = None
    stale: bool = False


class CacheController:
    """Prefetch from and write through to one ``StorageBackend`` for one worker.

    ``alloc(n, owner)`` hands out up to ``n`` host slots (the engine evicts L2 pages to
    make room); prefetched pages land there. ``call_timeout_s`` bounds every wait on an
    asynchronous backend (``wait_complete`` included); in-process backends answer at once.
    ``metrics`` (optional) records each request's prefetch and write: pages, bytes,
    seconds, by outcome. ``state_every`` (a hybrid layout's ``state_every_pages``) says
    where the read path looks for recurrent states.
    """

    def __init__(self, storage: StorageBackend, host_pool: PagePool, config: StorageConfig,
                 *, algo: str = "xxh3_128", stats: Stats | None = None,
                 alloc: Alloc | None = None, call_timeout_s: float = 30.0,
                 metrics: PDCacheMetrics | None = None, state_every: int = 4) -> None:
        self.stats = stats if stats is not None else Stats()
        self.link = StorageLink(storage, config, host_pool.layout, algo=algo,
                                stats=self.stats, call_timeout_s=call_timeout_s,
                                metrics=metrics, state_every=state_every)
        self.page_size, self.algo = self.link.page_size, algo
        self.state_every = state_every
        self.reader = Prefetcher(self.link, host_pool, alloc)
        self.writer = BackupWriter(self.link)

    def fetch(self, req: Req, names: Sequence[bytes], prefix: Sequence[bytes],
              l3_pages: int | None = None) -> StoredPages:
        """KV of the leading pages of ``names`` (after ``prefix``, the local hit's names)
        that L3 holds and a request can resume from: ``[k, *page_shape]`` for the first
        ``k`` of them (a hybrid prefix ends at its last page with a state; none: ``k = 0``).
        ``l3_pages``: a page index's count of the chain's leading pages L3 holds (only
        those are read; ``None``: no index, see ``Prefetcher.prefetch``). The host slots
        they landed in are free again when this returns."""
        fetched = self.reader.prefetch(req, names, prefix, l3_pages=l3_pages)
        try:
            n = fetched.resume_pages
            return StoredPages(fetched.read()[:n], fetched.cross_namespace,
                               {i: s for i, s in fetched.states.items() if i < n},
                               fetched.stale)
        finally:
            fetched.release()

    def write_through(self, req: Req, key: CacheKey, num_cached: int, pages: torch.Tensor,
                      states: Mapping[int, torch.Tensor]) -> None:
        """Back up the full pages of ``key`` after its first ``num_cached`` (KV ``pages[i]``
        of page ``i``; a hybrid model's ``states`` by page index, at their checkpoints) to
        L3, in the background."""
        if num_cached >= key.num_pages:
            return
        ps = self.page_size
        self.writer.backup(req, key.names[num_cached:],
                           key.tokens[num_cached * ps:key.num_pages * ps],
                           pages[num_cached:key.num_pages], key.names[:num_cached],
                           states={i - num_cached: s for i, s in states.items()})

    def held_after(self, names: Sequence[bytes], local: int, l3_pages: int | None,
                   stale: bool = False) -> int:
        """How many of a prompt's page ``names`` L3 holds once its prefill's write lands:
        all of them if it holds the first ``local`` (the local hit's), as ``l3_pages`` (a
        page index's count, unless the read found it ``stale``) or this worker's memory
        says (what it stored, read, or is writing: a hit another request computed here a
        moment ago), since the prefill read the rest from L3 or writes it; else those
        known."""
        known = self.link.held.prefix(names[:local])
        if l3_pages is not None and not stale:
            known = max(known, min(l3_pages, local))
        return len(names) if known >= local else known

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every write issued so far (``True``: all done)."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Finish the queued writes and stop the background thread."""
        self.writer.close()
