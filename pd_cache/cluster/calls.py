"""A worker's call as the router sees it: awaited (its own errors come back as themselves),
streamed (a prefill's answer first, its KV after) or abandoned (its caller went away)."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

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


class Streamed(NamedTuple):
    """A prefill call to ``worker`` streamed (``PrefillActor.prefill_stream``): its first
    item, the answer, taken; the prompt's KV pages and states (a hybrid prompt's) follow."""

    worker: int
    gen: Any


async def first_item(gen: Any) -> Any:
    """The first item of a streaming call (``ObjectRefGenerator``), awaited."""
    return await (await gen.__anext__())


async def handoff_refs(streamed: Streamed) -> list[Any]:
    """The refs of the KV pages and states that follow a streamed answer, once the call
    ended (both stored then, so neither value is fetched here); the call's error, if it
    failed after answering."""
    await streamed.gen.completed()
    return [next(streamed.gen), next(streamed.gen)]


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
