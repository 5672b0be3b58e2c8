"""A sealed get's pages opened, and a page that does not open read from its next copy::

    inner get -> open every page -> those that fail and are the reader's own (bad bytes, a
    key retired): the inner result's ``reject`` (``storage.replicas``: the copy that served
    them drops them, the next copy is read and repairs it) -> open those -> ... until each
    opened or no copy is left

A store of one copy (its result has no ``reject``) is told to discard them. A page another
tenant's key sealed is left alone (this reader cannot tell it is bad): a miss, not retried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pd_cache.storage.base import Pending, PoolTransfer, ShardFault
from pd_cache.storage.reader import OPENER


class OpenedPages(NamedTuple):
    """One transfer's pages opened (``None``: a miss), the positions of pages that came and
    did not open, those whose record should be dropped, and the first one's reason."""

    transfer: PoolTransfer
    refused: list[int]
    bad: list[int]
    refusal: ShardFault | None


OpenOne = Callable[[PoolTransfer, Any], OpenedPages]   # (transfer, its into tensors) -> OpenedPages


def open_each(inner: Pending[Any], got: Sequence[PoolTransfer], intos: Sequence[Any],
              open_one: OpenOne, discard: Callable[[str, list[bytes]], Any],
              faults: list[ShardFault]) -> list[PoolTransfer]:
    """``got`` (``inner``'s result) opened by ``open_one``, each transfer into its
    ``intos`` tensors; a refusal whose page stayed a miss is listed in ``faults`` (once per
    transfer), so a caller counts it by its reason."""
    opened = [open_one(t, into) for t, into in zip(got, intos)]
    pages = [list(o.transfer.pages or []) for o in opened]
    refusals = [o.refusal for o in opened]
    refused = [set(o.refused) for o in opened]
    bad = [o.bad for o in opened]
    reject = getattr(inner, "reject", None)
    while any(bad):
        if reject is None:   # NOTE: the store deletes them, so the page can be stored again
            for t, b in zip(got, bad):
                if b:
                    discard(t.pool, [t.keys[i] for i in b])
            break
        again = reject([[i in bs for i in range(len(t.keys))] for t, bs in zip(got, map(set, bad))])
        next_bad = []
        for j, (t, into, b) in enumerate(zip(again, intos, bad)):
            o = open_one(t, into) if b else OpenedPages(t, [], [], None)
            reread = o.transfer.pages or [None] * len(t.keys)
            for i in b:
                pages[j][i] = reread[i]
            next_bad.append(o.bad)
            refused[j].update(o.refused)
            refusals[j] = refusals[j] or o.refusal
        bad = next_bad
    for j, refusal in enumerate(refusals):
        if refusal is not None and any(pages[j][i] is None for i in refused[j]):
            faults.append(refusal)
    return [PoolTransfer(t.pool, t.keys, ps) for t, ps in zip(got, pages)]


def refusal(reason: Any, detail: str) -> ShardFault:
    """The fault a page that did not open makes (no shard's: the reader's)."""
    return ShardFault(OPENER, reason, detail)
