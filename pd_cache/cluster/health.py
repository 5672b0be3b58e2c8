"""Which workers are alive: the router's view of crashes and restarts.

A call that fails because the worker's process died marks that worker ``down`` in its
role's router (no request goes there) and starts a probe: a ``ready`` call, which Ray
queues until the restarted actor answers. Probes are object refs, looked at without
waiting before each routing decision, so they outlive any one asyncio loop::

    call fails (RayActorError)  ->  died(w): router.mark_down(w), probe = w.ready.remote()
    next request                ->  refresh(): probe answered? router.mark_up(w)
                                               probe failed?   probe again
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from pd_cache.cluster.router import PrefixRouter

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """The worker serving a request died under it (the request may be retried once)."""

    def __init__(self, role: str, worker: int, cause: BaseException) -> None:
        super().__init__(f"{role} worker {worker} died: {type(cause).__name__}")
        self.role, self.worker = role, worker


def worker_died(error: BaseException) -> bool:
    """Whether ``error`` says the worker process (or the pages it held) is gone, rather than
    that the request was bad."""
    import ray

    lost = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
    return isinstance(error, lost)


class Liveness:
    """The liveness of one role's workers (``actors``), kept in ``router.down``."""

    def __init__(self, role: str, actors: Sequence[Any], router: PrefixRouter) -> None:
        self.role, self.actors, self.router = role, list(actors), router
        self._probes: dict[int, Any] = {}

    def died(self, worker: int, cause: BaseException) -> WorkerDied:
        """Route around ``worker`` until it answers again; the error to raise."""
        if worker not in self.router.down:
            log.warning("%s worker %d died (%s); routing around it until it answers",
                        self.role, worker, type(cause).__name__)
        self.router.mark_down(worker)
        self._probes[worker] = self.actors[worker].ready.remote()
        return WorkerDied(self.role, worker, cause)

    def refresh(self) -> None:
        """Bring back the down workers whose probe has answered (never waits)."""
        import ray

        for worker, probe in list(self._probes.items()):
            ready, _ = ray.wait([probe], timeout=0)
            if not ready:
                continue
            try:
                ray.get(probe)
            except Exception:  # noqa: BLE001 - still restarting or gone: probe again
                self._probes[worker] = self.actors[worker].ready.remote()
                continue
            del self._probes[worker]
            self.router.mark_up(worker)
            log.warning("%s worker %d answers again", self.role, worker)

    async def check(self, timeout_s: float) -> list[int]:
        """Ping every worker (at most ``timeout_s``); the ones that answered. Updates the
        router: a worker that answers is up, one that fails is down."""
        self.refresh()
        answers = await ping_all([a.ready.remote() for a in self.actors], timeout_s)
        live = []
        for worker, answer in enumerate(answers):
            if isinstance(answer, BaseException):
                if worker_died(answer):
                    self.died(worker, answer)
            else:
                live.append(worker)
                if worker in self.router.down:
                    self._probes.pop(worker, None)
                    self.router.mark_up(worker)
        return live


async def ping_all(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Each call's answer, or the exception it ended with (a timeout after ``timeout_s``)."""
    # NOTE: wait_for cancels what it awaits on timeout; an ObjectRef wrapped as a future
    # can be cancelled without touching the actor.
    waits = [asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s) for ref in refs]
    return await asyncio.gather(*waits, return_exceptions=True)
