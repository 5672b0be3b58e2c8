"""Pins with a time to live: keys an eviction passes over until their pin lapses.

A request may pin its prompt's pages for ``ttl_s`` seconds (``Req.pin_ttl_s``). Each tier
that holds them keeps one ``Pins``: the radix tree of a worker (keys: its nodes) and each
L3 shard (keys: its records). A pin holds its key until ``until``; each hit renews it to
``now + ttl_s`` (``touch``); a second pin keeps the later expiry and the longer TTL::

    pin(k, 60) at t=0      until 60
    touch(k)   at t=50     until 110
    expired()  at t=111    [k]: an eviction may take k again

An eviction that meets a held key sets it aside; ``expired()`` names the keys whose pins
have lapsed since it was last asked, for it to take them back. Times are the owner's
clock (``time.monotonic`` in a process; a test injects one).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, NamedTuple, TypeVar

K = TypeVar("K", bound=Hashable)

#: OpenAI's ``prompt_cache_retention`` values and the pin each one maps to (seconds).
RETENTION_TTL_S = {"24h": 24 * 3600.0}


class Pin(NamedTuple):
    """Held until ``until`` (the owner's clock); a hit renews it by ``ttl_s``. ``owner``
    names whose limit it counts against (a tenant, or its owner label in L3)."""

    until: float
    ttl_s: float
    owner: str = ""


def pinned_page_limit(fraction: float, *capacities: int) -> int:
    """The most pages pinned at once over pools of these capacities that each hold at most
    ``fraction`` of their pages pinned (a worker's device and host pools: a pinned page is
    held in one of them)."""
    return sum(int(fraction * c) for c in capacities)


def check_ttl(field: str, ttl_s: object) -> float:
    """``ttl_s`` as a float >= 0 (0: no pin), or ``ValueError`` naming ``field``."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s >= 0 \
            or ttl_s == float("inf"):
        raise ValueError(f"{field}: expected a number of seconds >= 0, got {ttl_s!r}")
    return float(ttl_s)


class Pins(Generic[K]):
    """The pinned keys of one tier and when each pin lapses."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._pins: dict[K, Pin] = {}
        self._expiry: list[tuple[float, int, K]] = []   # heap; an entry may be stale
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, key: object) -> bool:
        return key in self._pins

    def pin(self, key: K, ttl_s: float, owner: str = "") -> None:
        """Hold ``key`` for ``ttl_s`` seconds from now (or longer, if already pinned)."""
        old = self._pins.get(key)
        until = self.clock() + ttl_s
        if old is not None:
            until, ttl_s = max(until, old.until), max(ttl_s, old.ttl_s)
        self._set(key, Pin(until, ttl_s, owner or (old.owner if old else "")))

    def touch(self, key: K) -> None:
        """A hit: a held ``key``'s pin runs ``ttl_s`` from now (a lapsed one stays lapsed)."""
        pin = self._pins.get(key)
        now = self.clock()
        if pin is not None and pin.until > now:
            self._set(key, pin._replace(until=max(pin.until, now + pin.ttl_s)))

    def held(self, key: K) -> bool:
        """Whether ``key`` is pinned and its pin has not lapsed."""
        pin = self._pins.get(key)
        return pin is not None and pin.until > self.clock()

    def drop(self, key: K) -> Pin | None:
        """Forget ``key``'s pin (it left the tier)."""
        return self._pins.pop(key, None)

    def end(self, key: K) -> None:
        """``key``'s pin lapses now (an operator dropped it): ``expired()`` names it next."""
        pin = self._pins.get(key)
        if pin is not None:
            self._set(key, pin._replace(until=min(pin.until, self.clock())))

    def expired(self) -> list[K]:
        """The keys whose pins lapsed since the last call; forgotten here."""
        now, out = self.clock(), []
        while self._expiry and self._expiry[0][0] <= now:
            _, _, key = heapq.heappop(self._expiry)
            pin = self._pins.get(key)
            if pin is not None and pin.until <= now:
                del self._pins[key]
                out.append(key)
        return out

    def items(self) -> Iterator[tuple[K, Pin]]:
        """Every held key and its pin (lapsed ones are left out)."""
        now = self.clock()
        return ((k, p) for k, p in list(self._pins.items()) if p.until > now)

    def _set(self, key: K, pin: Pin) -> None:
        self._pins[key] = pin
        heapq.heappush(self._expiry, (pin.until, next(self._seq), key))
        if len(self._expiry) > 2 * len(self._pins) + 64:   # renewals leave stale entries
            self._expiry = [(p.until, next(self._seq), k) for k, p in self._pins.items()]
            heapq.heapify(self._expiry)
