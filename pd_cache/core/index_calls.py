"""The page index's answer about one prompt, still under way.

A front that need not wait for the index to route (one live prefill worker, and no decode
choice left to it) sends the prefill call at once and hands the worker the index's query
calls instead of their answer; the worker waits for them only when it reads L3, so the
query runs while the call travels and the prompt is matched locally::

    front:  shard.query.remote(names_k) per shard  ->  IndexCalls(calls, where, timeout_s)
            prefill.remote(req, ..., IndexCalls)       (refs nested: passed on unresolved)
    worker: local match, then l3_held(get(calls))  ->  the leading pages L3 holds

A shard's view (its ``query``'s answer) is ``(masks, holders)``: per name asked the bit
mask of its holders, and each bit's ``(publisher, tier)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pd_cache.core.events import STORAGE_TIER

View = tuple[Sequence[int], Sequence[tuple[str, str]]]   # (masks, holders)


class IndexCalls(NamedTuple):
    """Per index shard, its ``query`` call (an object ref; ``None``: nothing asked of it);
    ``where[i]``: name ``i``'s (shard, position in that shard's answer); how long an answer
    may be waited for (``index_timeout_s``)."""

    calls: list[Any]
    where: list[tuple[int, int]]
    timeout_s: float

    def views(self, got: Sequence[View]) -> list[View]:
        """Every shard's view, from ``got`` (the answers of the calls made, in order)."""
        answers = iter(got)
        return [next(answers) if call is not None else ([], []) for call in self.calls]


def l3_held(views: Sequence[View], where: Sequence[tuple[int, int]]) -> int:
    """How many leading names of a prompt L3 holds, from its shards' ``views``."""
    stored = [sum(1 << bit for bit, (_, tier) in enumerate(holders) if tier == STORAGE_TIER)
              for _, holders in views]
    return next((i for i, (s, j) in enumerate(where) if not views[s][0][j] & stored[s]),
                len(where))


# NOTE: what prefill takes for the leading pages L3 holds: a count, a function answering it
# once the worker needs it (``None`` from either: unknown), or ``None``.
L3Pages = int | Callable[[], int | None] | None
