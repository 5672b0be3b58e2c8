"""A clock a test moves by hand, for code that takes ``clock: Callable[[], float]``."""

from __future__ import annotations


class Clock:
    """Reads ``now`` (seconds; 100 to start): set it to move time on."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
