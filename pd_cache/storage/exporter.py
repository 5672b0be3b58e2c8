"""``StatsExporter``: one L3 shard exports its own counts, from inside its own process.

Hits, misses by reason, stored, evicted, refused and verification failures are counted by
the shard's backend (``Stats``); a daemon thread hands each new snapshot to
``PDCacheMetrics.count_storage_stats`` every ``interval_s``. Run inside the storage actor,
the counts reach the node's metrics port in every deployment (``pd-cache run``, a
``PDCluster`` in a user's driver, the Serve app); a restarted shard reads as a counter
reset, as Prometheus treats one. The calls the shard answered (by op) go out the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pd_cache.metrics import PDCacheMetrics
from pd_cache.storage.base import Usage

log = logging.getLogger(__name__)


class StatsExporter:
    """Exports ``snapshot()`` through ``metrics`` now and every ``interval_s`` after ``start``."""

    def __init__(self, snapshot: Callable[[], dict[str, int]], backend: str, source: str,
                 interval_s: float, metrics: PDCacheMetrics | None = None,
                 usage: Callable[[], Usage] | None = None,
                 calls: Callable[[], dict[str, int]] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: expected a number > 0, got {interval_s!r}")
        self.snapshot, self.backend, self.source = snapshot, backend, source
        self.usage, self.calls = usage, calls
        self.interval_s = interval_s
        self.metrics = metrics if metrics is not None else PDCacheMetrics("auto")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pd-cache-stats",
                                        daemon=True)

    def export(self) -> None:
        """Add what the shard counted since the last export; set its bytes held."""
        self.metrics.count_storage_stats(self.snapshot(), backend=self.backend,
                                         source=self.source)
        if self.calls is not None:
            self.metrics.count_storage_calls(self.calls(), source=self.source)
        if self.usage is not None:
            now = self.usage()
            self.metrics.set_storage_usage(now.bytes, now.capacity_bytes, self.backend)

    def start(self) -> StatsExporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.export()
            except Exception:  # noqa: BLE001 - metrics never take a shard down
                log.exception("L3 %s: stats not exported", self.source)
