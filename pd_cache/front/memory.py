"""Giving a burst's memory back once the ingress is quiet again.

NOTE: glibc's malloc keeps what a process frees for reuse and returns to the system only
the free memory at the top of its heap. A burst of concurrent connections leaves the heap
full of free chunks between live ones: 500 connections at once left the ingress replica
+71 MiB resident 15 s later; ``malloc_trim(0)``, which also hands back the free pages in
the middle of the heap, brought that to +20 MiB, while ``MALLOC_ARENA_MAX=2`` (+67) and
``MALLOC_TRIM_THRESHOLD_`` (+61) hardly helped (benchmarks/bench_burst.py). So the ingress
trims once it has no request left after a burst, and only then: a trim costs milliseconds
on the event loop, which is idle at that moment.

Serve's HTTP proxy (Ray's process) keeps a burst's heap the same way (+45 MiB after 500 at
once; +54 after three such bursts; +21 after ``malloc_trim(0)``). Ray lets a deployment add
ASGI middlewares to its proxy: ``PROXY_CALLBACK_ENV`` names ``proxy_middlewares`` to the
proxy, which wraps every HTTP request in the same idle trim (``TrimWhenIdle``).

NOTE: the trim reaches only what glibc's malloc holds. CPython keeps objects under 512 bytes
in arenas of its own, returned only when wholly empty: after 1,000 connections at once that
left the ingress +41.5 MiB and the proxy +38.8 60 s later despite the trim. With
``PYTHONMALLOC=malloc`` (the front's env in deployments/serve_config.yaml) they come from
malloc too: +8.7 and +20.3.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Any

TRIM_AFTER_PEAK = 64   # requests at once: what counts as a burst
TRIM_DELAY_S = 1.0     # quiet this long first (a burst's tail often comes in waves)
# Serve's proxy calls the function this names for a list of Starlette middlewares; it must be
# in the proxy's environment (a job's runtime_env env_vars, or the pod's env on Kubernetes).
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "pd_cache.front.memory:proxy_middlewares"


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``; ``None`` where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    return None if trim is None else lambda: trim(0)


class IdleTrim:
    """Counts the requests in flight; ``TRIM_DELAY_S`` after they drop to none, having been
    ``TRIM_AFTER_PEAK`` or more at once, calls ``trim`` (if still none are in flight).

    Call ``enter`` when a request arrives and ``leave`` (on the event loop) when it is
    answered, every one, refused ones too: a refused request allocates as an admitted one.
    """

    def __init__(self, trim: Callable[[], object] | None, *,
                 after_peak: int = TRIM_AFTER_PEAK, delay_s: float = TRIM_DELAY_S) -> None:
        self.trim = trim
        self.after_peak, self.delay_s = after_peak, delay_s
        self.inflight = self.peak = self.trims = 0
        self._scheduled = False

    def enter(self) -> None:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self.peak >= self.after_peak and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(self.delay_s, self._quiet)

    def _quiet(self) -> None:
        self._scheduled = False
        if self.inflight:   # busy again: the next time it empties decides
            return
        self.peak = 0
        if self.trim is not None:
            self.trim()
            self.trims += 1


class TrimWhenIdle:
    """ASGI middleware: every HTTP request through ``app`` is counted by an ``IdleTrim``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.idle = IdleTrim(malloc_trim())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.idle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.idle.leave()


def proxy_middlewares() -> list[Any]:
    """The middlewares of Serve's proxy (``PROXY_CALLBACK``)."""
    from starlette.middleware import Middleware

    return [Middleware(TrimWhenIdle)]
