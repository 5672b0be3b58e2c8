"""A worker's call as the router sees it: awaited (its own errors come back as themselves)
or abandoned (its caller went away)."""

from __future__ import annotations

import logging
from typing import Any

from pd_cache.core.request import DeadlineExceeded

log = logging.getLogger(__name__)


async def unwrap(ref: Any) -> Any:
    """Await a Ray call; a ``ValueError`` or ``DeadlineExceeded`` raised in the actor comes
    back as itself."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayTaskError as exc:
        for kind in (ValueError, DeadlineExceeded):
            if isinstance(exc.cause, kind):
                raise kind(str(exc.cause)) from None
        raise


def abandon(ref: Any | None) -> None:
    """Cancel the actor call behind ``ref`` (an object ref or a streaming generator) if it
    has not started: Ray drops it from the actor's queue. A started call runs on (Ray does
    not interrupt a threaded or plain actor's calls); a decode leaves its batch by
    ``DecodeActor.cancel``."""
    import ray

    if ref is None:   # the call was never made
        return
    try:
        ray.cancel(ref)
    except Exception as exc:  # noqa: BLE001 - best effort: the call may be gone already
        log.debug("cancel of %s: %s", ref, exc)
