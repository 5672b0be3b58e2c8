"""``CacheController``: one worker's link between its host pool (L2) and L3.

It puts the two paths side by side over one ``StorageLink``::

    Prefetcher    read path: query, then L3 -> host slots, verified   (caller's thread)
    BackupWriter  write path: new full pages -> batch_set             (background thread)

Both take the request's page names as the worker computed them, with the names before
them (``prefix``); neither hashes a prompt again. A storage fault (a raise, a timeout, a
bad record) never fails the request: the pages it would have supplied are recomputed,
and the fault is counted in ``stats`` by reason.
"""

from __future__ import annotations

from pd_cache.core.config import StorageConfig
from pd_cache.core.stats import Stats
from pd_cache.kv.pool import PagePool
from pd_cache.metrics import PDCacheMetrics
from pd_cache.storage.base import StorageBackend
from pd_cache.tiering.backup import BackupWriter
from pd_cache.tiering.link import StorageLink
from pd_cache.tiering.prefetch import Alloc, Prefetcher


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
        self.prefetch = self.reader.prefetch
        self.backup = self.writer.backup
        self.flush = self.writer.flush

    def close(self) -> None:
        """Finish the queued backups and stop the background thread."""
        self.writer.close()
