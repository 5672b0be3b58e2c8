"""A request's way through the ingress: admission (at most ``max_pending`` at once, a fair
share of them per tenant), a stream primed before Serve reads it, and the error a failed
request answers with. Admitted requests wait for their prefill by tenant, in turn
(``pd_cache.cluster.turns``)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

from pd_cache.cluster.health import WorkerDied
from pd_cache.cluster.router import NoLiveWorker
from pd_cache.core.request import DeadlineExceeded, Req
from pd_cache.front.http import HTTPError, value_error

log = logging.getLogger(__name__)


class Admission:
    """At most ``limit`` requests admitted at once; beyond, 429 with ``Retry-After``. A
    tenant holding less than its even share (``limit`` / the tenants holding requests,
    itself included) is admitted even when the replica is full, up to ``2 x limit`` in all:
    one tenant's flood fills the queue but keeps no other out of its share (open mode is
    one tenant, ``""``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0
        self.by_tenant: collections.Counter[str] = collections.Counter()

    def place(self, tenant: str = "") -> Place:
        """Hold one of the places until the returned ``Place`` is left."""
        if self.pending >= self.limit and not self._within_share(tenant):
            raise HTTPError(429, f"{self.pending} requests pending; retry shortly", None,
                            "overloaded", {"Retry-After": "1"})
        return Place(self, tenant)

    def _within_share(self, tenant: str) -> bool:
        held = self.by_tenant[tenant]
        tenants = len(self.by_tenant) + (not held)
        return self.pending < 2 * self.limit and held < self.limit // tenants


class Place:
    """One admitted request: counted while held, released once."""

    def __init__(self, admission: Admission, tenant: str = "") -> None:
        self.admission, self.tenant = admission, tenant
        admission.pending += 1
        admission.by_tenant[tenant] += 1
        self._held = True

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._held = False
            self.admission.pending -= 1
            self.admission.by_tenant[self.tenant] -= 1
            if not self.admission.by_tenant[self.tenant]:
                del self.admission.by_tenant[self.tenant]


async def primed(first: asyncio.Future[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first``'s item, then ``rest``'s; a consumer that stops early cancels ``first``."""
    try:
        yield await first
        async for item in rest:
            yield item
    finally:
        first.cancel()


def unavailable(req: Req, exc: BaseException) -> HTTPError:
    """The HTTP error for a request that failed with ``exc``."""
    if isinstance(exc, ValueError):
        return value_error(exc)
    if isinstance(exc, (asyncio.TimeoutError, DeadlineExceeded)):
        return HTTPError(503, "no answer before the request's deadline", None, "timeout")
    if isinstance(exc, (NoLiveWorker, WorkerDied)):
        return HTTPError(503, str(exc), None, "unavailable")
    log.warning("request %s failed: %s: %s", req.rid, type(exc).__name__, exc)
    return HTTPError(503, f"internal fault: {type(exc).__name__}", None, "internal")


__all__ = ["Admission", "Place", "primed", "unavailable"]
