"""Rate limits per API key: token buckets for requests per second and tokens per minute.

A key's ``requests_per_s`` bucket holds one second's worth of requests (at least one) and
refills continuously; its ``tokens_per_min`` bucket holds a minute's worth of tokens, where a
request costs its prompt plus its largest answer (``max_tokens``), charged when admitted.
A request is admitted when every bucket of its key holds its cost, and then takes from each;
refused, it takes nothing and is told when to retry. A request that costs more than the
key's whole ``tokens_per_min`` can never pass and is refused without a time to retry.

With ``replicas`` ingress replicas each keeps its own buckets, split evenly: rate and size
are divided by ``replicas`` (no shared state, no extra hop on the request path; Serve spreads
requests across replicas, so a key's total stays near its limit). A request too big for a
replica's share is admitted when that replica's bucket is full and leaves it in debt, so the
long-run rate still holds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

from pd_cache.front.keyfile import KeyRate

_EPSILON = 1e-9


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; starts full."""

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        if capacity <= 0 or rate <= 0:
            raise ValueError(f"bucket: capacity and rate must be > 0, got {capacity}, {rate}")
        self.capacity, self.rate = capacity, rate
        self.level, self._at = capacity, now

    def refill(self, now: float) -> float:
        """The level at ``now`` (the bucket never runs backwards in time)."""
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now
        return self.level

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` may be taken: it needs ``cost`` tokens, or a full bucket."""
        need = min(cost, self.capacity) - self.refill(now)
        return need / self.rate if need > _EPSILON else 0.0   # float sums fall a hair short

    def take(self, cost: float) -> None:
        self.level -= cost   # may go below zero: an oversize cost taken from a full bucket

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.refill(now)) / self.rate


class Refusal(NamedTuple):
    """A refused request: why, and when to retry (``None``: never, it is too large)."""

    message: str
    retry_after_s: float | None
    headers: dict[str, str]


class KeyBuckets:
    """The buckets of one key, at one replica (its share of the key's limits)."""

    def __init__(self, rate: KeyRate, replicas: int, now: float) -> None:
        self.rate = rate
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        if rate.requests_per_s is not None:
            share = rate.requests_per_s / replicas
            self.requests = TokenBucket(max(1.0, share), share, now)
        if rate.tokens_per_min is not None:
            share = rate.tokens_per_min / replicas
            self.tokens = TokenBucket(share, share / 60, now)

    def admit(self, tokens: int, now: float) -> Refusal | None:
        """Take one request and ``tokens``; or take nothing and say why."""
        limit = self.rate.tokens_per_min
        if limit is not None and tokens > limit:
            return Refusal(f"this request's {tokens} tokens (prompt + max_tokens) exceed this "
                           f"key's limit of {limit} tokens per minute",
                           None, self.headers(now))
        waits = {"requests": self._wait(self.requests, 1, now),
                 "tokens": self._wait(self.tokens, tokens, now)}
        wait = max(waits.values())
        if wait > 0:
            which = max(waits, key=waits.__getitem__)
            return Refusal(f"rate limit of this key's {which} reached; retry in {wait:.2f} s",
                           wait, self.headers(now))
        for bucket, cost in ((self.requests, 1), (self.tokens, tokens)):
            if bucket is not None:
                bucket.take(cost)
        return None

    @staticmethod
    def _wait(bucket: TokenBucket | None, cost: float, now: float) -> float:
        return 0.0 if bucket is None else bucket.wait_s(cost, now)

    def headers(self, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for this replica's buckets."""
        out = {}
        for what, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{what}"] = str(math.floor(bucket.capacity))
                out[f"x-ratelimit-remaining-{what}"] = str(max(0, math.floor(
                    bucket.refill(now))))
                out[f"x-ratelimit-reset-{what}"] = duration(bucket.reset_s(now))
        return out


class RateLimiter:
    """The buckets of every rate-limited key at this replica, made on a key's first use."""

    def __init__(self, replicas: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        if replicas < 1:
            raise ValueError(f"replicas: expected >= 1, got {replicas}")
        self.replicas, self._clock = replicas, clock
        self._keys: dict[str, KeyBuckets] = {}

    def admit(self, key_id: str, rate: KeyRate, tokens: int) -> Refusal | None:
        """Admit one request of ``tokens`` for the key; a ``Refusal`` when over its rate."""
        if rate == KeyRate():
            return None
        now = self._clock()
        buckets = self._keys.get(key_id)
        if buckets is None:
            buckets = self._keys[key_id] = KeyBuckets(rate, self.replicas, now)
        return buckets.admit(tokens, now)


def duration(seconds: float) -> str:
    """A wait as OpenAI's headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def retry_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (HTTP), and in ms as OpenAI's clients also read."""
    return {"Retry-After": str(max(1, math.ceil(seconds))),
            "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}
