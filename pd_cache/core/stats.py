"""Event counts by reason, in one place: every tier counts here, metrics export from here.

The words counted are those of ``pd_cache.core.vocab``.
"""

from __future__ import annotations

import threading
from collections import Counter

from pd_cache.core.vocab import Event, MissReason, text


class Stats:
    """Thread-safe counts keyed by ``(event, reason)``; ``reason`` is ``""`` when none.

    ``snapshot()`` returns a plain dict ``{"event/reason": count}`` that crosses actor
    boundaries and is what ``pd_cache.metrics`` exports.
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def count(self, event: Event | str, reason: MissReason | str = "", n: int = 1) -> None:
        key = (text(event), text(reason))
        with self._lock:
            self._counts[key] += n

    def get(self, event: Event | str, reason: MissReason | str = "") -> int:
        with self._lock:
            return self._counts[(text(event), text(reason))]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{e}/{r}": n for (e, r), n in sorted(self._counts.items())}

    def merge(self, snapshot: dict[str, int]) -> None:
        """Add another ``snapshot()`` (for example one shard's) into these counts."""
        for key, n in snapshot.items():
            event, _, reason = key.partition("/")
            self.count(event, reason, n)

