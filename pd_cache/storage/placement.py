"""Which L3 shard holds a page: rendezvous hashing per chain segment.

A chain's pages are cut into segments of ``segment_pages`` consecutive pages, counted from
the chain's first page; a segment lives on one shard, the one with the highest
``xxh3_64(name, seed=shard)`` for the name of the segment's first page (its anchor). A
reader finds the shard from the chain's names alone, with no lookup: the names it computed
for its prompt give each page's position and its segment's anchor::

    position   0  1  2  3 | 4  5  6  7 | 8  9        segment_pages = 4
    anchor     n0         | n4         | n8
    shard      r(n0)      | r(n4)      | r(n8)       r = rendezvous

So a write of a run of new pages, or a read past a local hit, reaches one shard (two when
it crosses a segment's end), and adding a shard moves only the segments it wins. Without a
chain (``prefix`` ``None``: the caller gave no ``ExtraInfo.prefix_keys``) each page is a
segment of its own, placed by its own name; readers and writers of one deployment share
``storage.prefix_keys``, so they agree on the rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def rendezvous(name: bytes, num_shards: int) -> int:
    """The shard that owns ``name``: highest random weight, stable across processes."""
    if num_shards == 1:
        return 0
    return max(range(num_shards), key=lambda s: xxhash.xxh3_64_intdigest(name, seed=s))


def chain_shards(keys: Sequence[bytes], prefix: Sequence[bytes] | None, num_shards: int,
                 segment_pages: int) -> list[int]:
    """The shard of each of ``keys``: consecutive pages of a chain right after ``prefix``
    (the chain's names before them, from its first page; ``None``: no chain known, each
    page placed by its own name)."""
    if prefix is None or num_shards == 1:
        return [rendezvous(k, num_shards) for k in keys]
    before, owners, out = len(prefix), {}, []
    for i in range(len(keys)):
        at = before + i
        first = at - at % segment_pages
        anchor = prefix[first] if first < before else keys[first - before]
        if anchor not in owners:
            owners[anchor] = rendezvous(anchor, num_shards)
        out.append(owners[anchor])
    return out
