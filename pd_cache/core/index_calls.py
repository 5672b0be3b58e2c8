"""The page index asked by the prefill worker itself, when the front need not wait for it.

A front that has no choice for the index to make (one live prefill worker, and no decode
choice left to it) sends the prefill call at once with ``AskIndex`` in place of the count
of leading pages L3 holds; the worker asks the index's shards once its local hit is known,
with its own page names, and reads from L3 what they vouch for::

    front:  prefill.remote(req, ..., AskIndex(timeout_s))       no round trip first
    worker: local match -> locate(names) -> shard.query per shard -> l3_held(views)

A shard's view (its ``query``'s answer) is ``(masks, holders)``: per name asked the bit
mask of its holders, and each bit's ``(publisher, tier)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from pd_cache.core.events import STORAGE_TIER, shard_of

View = tuple[Sequence[int], Sequence[tuple[str, str]]]   # (masks, holders)


class AskIndex(NamedTuple):
    """Ask the page index for the count (``PrefillActor``), waiting at most ``timeout_s``
    (``index_timeout_s``) for its shards' answers."""

    timeout_s: float


def locate(names: Sequence[bytes], num_shards: int) -> tuple[list[list[bytes]],
                                                           list[tuple[int, int]]]:
    """The names each shard is asked about, and where each of ``names`` is among them
    (``(shard, position)``, what ``l3_held`` and the index's ``answer`` take)."""
    asked: list[list[bytes]] = [[] for _ in range(num_shards)]
    where = []
    for name in names:
        k = shard_of(name, num_shards)
        where.append((k, len(asked[k])))
        asked[k].append(name)
    return asked, where


def l3_held(views: Sequence[View], where: Sequence[tuple[int, int]]) -> int:
    """How many leading names of a prompt L3 holds, from its shards' ``views``."""
    stored = [sum(1 << bit for bit, (_, tier) in enumerate(holders) if tier == STORAGE_TIER)
              for _, holders in views]
    return next((i for i, (s, j) in enumerate(where) if not views[s][0][j] & stored[s]),
                len(where))


# NOTE: what prefill takes for the leading pages L3 holds: a count, a function of the
# prompt's page names answering it (``None``: unknown), or ``None`` (no index).
L3Pages = int | Callable[[Sequence[bytes]], int | None] | None
