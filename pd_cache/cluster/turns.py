"""Turns at the prefill workers: a bounded number of prefill calls out at once, the rest
waiting in the router by tenant and let in one tenant at a time.

A prefill worker runs its calls in order, so a request handed to it waits behind every call
already there, whoever sent them. ``Turns`` keeps that queue short (``slots``: the cluster's
``prefill_queue_depth`` per prefill worker) and holds the rest in the router, one queue per
tenant (``Req.tenant``: the key file's tenant; ``""`` in open mode and for a library caller,
one tenant). A freed slot goes to the tenant next in turn, round robin over the tenants
with a request waiting, first come first served within a tenant::

    waiting   N: n1 n2 n3 n4      Q: q1            slots free one by one
    granted   n1, q1, n2, n3, n4                    Q waits one turn, not behind all of N

A tenant within its share (no more requests than the others at once) is thus served at
once or within a turn per other tenant waiting, however long another's queue grows. A
waiter whose task is cancelled (its client went away, the ingress's deadline) leaves its
queue; one granted as it is cancelled hands its slot on. The router runs on one asyncio
loop, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pd_cache.core.fields import check_int_at_least


class Turns:
    """At most ``slots`` holders at once (0: no bound); waiters let in by tenant in turn."""

    def __init__(self, slots: int) -> None:
        check_int_at_least("slots", slots, 0)
        self.slots, self.held = slots, 0
        # NOTE: the dict's order is the turn: a tenant served goes to the back.
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    def waiting(self, tenant: str | None = None) -> int:
        """Requests waiting for a turn (``tenant``'s, when given)."""
        queues = self._waiting.values() if tenant is None else [self._waiting.get(tenant, ())]
        return sum(len(q) for q in queues)

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        """Hold a slot for the block; wait for ``tenant``'s turn first if none is free."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant: str) -> None:
        if not self.slots or (self.held < self.slots and not self._waiting):
            self.held += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, collections.deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():   # granted as it was cancelled
                self._release()
            else:
                self._leave(tenant, waiter)
            raise

    def _release(self) -> None:
        self.held -= 1
        while self._waiting and (not self.slots or self.held < self.slots):
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            waiter = queue.popleft()
            if queue:
                self._waiting[tenant] = queue   # its next request waits for its next turn
            if not waiter.done():
                waiter.set_result(None)
                self.held += 1

    def _leave(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[tenant]
