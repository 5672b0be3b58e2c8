"""Event counts by reason, in one place: every tier counts here, metrics export from here.

The vocabularies are fixed and small, so they can be metric labels as they are.
"""

from __future__ import annotations

import threading
from collections import Counter
from enum import Enum


class MissReason(str, Enum):
    """Why an L3 lookup did not produce a usable page."""

    NOT_STORED = "not_stored"
    EVICTED = "evicted"
    VERIFICATION_FAILED = "verification_failed"
    NAMESPACE_REFUSED = "namespace_refused"
    TIMEOUT = "timeout"
    STORAGE_ERROR = "storage_error"


class Event(str, Enum):
    """What happened to a page at a tier."""

    HIT = "hit"
    MISS = "miss"
    STORED = "stored"
    EVICTED = "evicted"
    REFUSED = "refused"
    VERIFICATION_FAILED = "verification_failed"


class Stats:
    """Thread-safe counts keyed by ``(event, reason)``; ``reason`` is ``""`` when none.

    ``snapshot()`` returns a plain dict ``{"event/reason": count}`` that crosses actor
    boundaries and is what ``pd_cache.metrics`` exports.
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def count(self, event: Event | str, reason: MissReason | str = "", n: int = 1) -> None:
        key = (_text(event), _text(reason))
        with self._lock:
            self._counts[key] += n

    def get(self, event: Event | str, reason: MissReason | str = "") -> int:
        with self._lock:
            return self._counts[(_text(event), _text(reason))]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{e}/{r}": n for (e, r), n in sorted(self._counts.items())}

    def merge(self, snapshot: dict[str, int]) -> None:
        """Add another ``snapshot()`` (for example one shard's) into these counts."""
        for key, n in snapshot.items():
            event, _, reason = key.partition("/")
            self.count(event, reason, n)


def _text(value: Enum | str) -> str:
    return value.value if isinstance(value, Enum) else value
