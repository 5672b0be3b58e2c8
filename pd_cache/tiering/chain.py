"""``Chain``: a run of a request's page names and where it sits in the request's chain.

Names are computed once per process (the engine's ``CacheKey``) and handed down with the
names before them; nothing in the tiering layer hashes a prompt again::

    seed  n0 n1 n2 | n3 n4 n5      prefix = [n0 n1 n2], names = [n3 n4 n5]
                     prior(0) = n2, prior(1) = n3; with no prefix, prior(0) = seed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pd_cache.core.hashing import namespace_seed
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
        return cls(list(names), list(prefix), namespace_seed(req.extra_key, req.cache_salt, algo))

    def prior(self, i: int) -> bytes:
        """The name page ``names[i]`` hashes from."""
        if i > 0:
            return self.names[i - 1]
        return self.prefix[-1] if self.prefix else self.seed


def batches(names: list[bytes], size: int) -> list[list[bytes]]:
    """``names`` cut into runs of at most ``size``, in order."""
    return [names[i:i + size] for i in range(0, len(names), size)]
