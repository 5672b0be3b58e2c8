"""``Chain``: a run of a request's page names and where it sits in the request's chain.

Names are computed once per process (the engine's ``CacheKey``) and handed down with the
names before them; nothing in the tiering layer hashes a prompt again::

    seed  n0 n1 n2 | n3 n4 n5      prefix = [n0 n1 n2], names = [n3 n4 n5]
                     prior(0) = n2, prior(1) = n3; with no prefix, prior(0) = seed
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from pd_cache.core.request import Req


class Chain(NamedTuple):
    """``names`` of a request's pages, after ``prefix``, in the namespace ``seed`` names."""

    names: list[bytes]
    prefix: list[bytes]   # the chain's names before ``names`` (from the namespace seed)
    seed: bytes

    @classmethod
    def of(cls, req: Req, names: Sequence[bytes], prefix: Sequence[bytes] = (), *,
           algo: str = "xxh3_128") -> Chain:
        """``names`` (after ``prefix``) in ``req``'s own namespace."""
        return cls(list(names), list(prefix), req.namespace_seed(algo))

    def prior(self, i: int) -> bytes:
        """The name page ``names[i]`` hashes from."""
        if i > 0:
            return self.names[i - 1]
        return self.prefix[-1] if self.prefix else self.seed


def batches(names: list[bytes], size: int) -> list[list[bytes]]:
    """``names`` cut into runs of at most ``size``, in order."""
    return [names[i:i + size] for i in range(0, len(names), size)]


def runs(n: int, size: int, ends: Collection[int] = ()) -> list[range]:
    """Indexes ``0 .. n - 1`` cut into runs of at most ``size``, in order; an index in
    ``ends`` closes its run (so a sidecar pool covering that page is a trailing one)::

        n = 10, size = 4, ends = {3, 7, 9}     0..3 | 4..7 | 8..9
        n = 10, size = 3, ends = {4}           0..2 | 3..4 | 5..7 | 8..9
    """
    out, lo = [], 0
    for i in range(n):
        if i - lo + 1 == size or i in ends or i == n - 1:
            out.append(range(lo, i + 1))
            lo = i + 1
    return out
