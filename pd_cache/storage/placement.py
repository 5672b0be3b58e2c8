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

With ``storage.replicas`` R > 1 a segment lives on its top R shards in rendezvous order
(``replica_set``), the first one the same shard as with R = 1; where the shards sit on
several nodes, the set takes the best shard of each node not yet in it before a second
shard of any node, so one node's loss leaves a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def rendezvous(name: bytes, num_shards: int) -> int:
    """The shard that owns ``name``: highest random weight, stable across processes."""
    if num_shards == 1:
        return 0
    return max(range(num_shards), key=lambda s: xxhash.xxh3_64_intdigest(name, seed=s))


def replica_set(name: bytes, num_shards: int, replicas: int,
                nodes: Sequence[str] | None = None) -> tuple[int, ...]:
    """The ``replicas`` shards that hold ``name``'s segment, best first: rendezvous order,
    one shard per node (``nodes[s]``: shard ``s``'s node; ``None``: one node) while there
    are nodes left, then the best of the rest."""
    if replicas == 1:
        return (rendezvous(name, num_shards),)
    order = sorted(range(num_shards), reverse=True,
                   key=lambda s: xxhash.xxh3_64_intdigest(name, seed=s))
    if nodes is None:
        return tuple(order[:replicas])
    picked: list[int] = []
    for s in order:
        if len(picked) < replicas and all(nodes[p] != nodes[s] for p in picked):
            picked.append(s)
    picked += [s for s in order if s not in picked][:replicas - len(picked)]
    return tuple(picked)


def anchors(keys: Sequence[bytes], prefix: Sequence[bytes] | None,
            segment_pages: int) -> list[bytes]:
    """The name that places each of ``keys``: its segment's first page's (each page's own
    without a chain)."""
    if prefix is None:
        return list(keys)
    before = len(prefix)
    out = []
    for i in range(len(keys)):
        first = before + i - (before + i) % segment_pages
        out.append(prefix[first] if first < before else keys[first - before])
    return out


def chain_replicas(keys: Sequence[bytes], prefix: Sequence[bytes] | None, num_shards: int,
                   segment_pages: int, replicas: int = 1,
                   nodes: Sequence[str] | None = None) -> list[tuple[int, ...]]:
    """The replica set of each of ``keys`` (``replica_set`` of its anchor), for
    consecutive pages of a chain right after ``prefix`` (as ``chain_shards``)."""
    sets: dict[bytes, tuple[int, ...]] = {}
    out = []
    for anchor in anchors(keys, prefix, segment_pages):
        if anchor not in sets:
            sets[anchor] = replica_set(anchor, num_shards, replicas, nodes)
        out.append(sets[anchor])
    return out


def chain_shards(keys: Sequence[bytes], prefix: Sequence[bytes] | None, num_shards: int,
                 segment_pages: int) -> list[int]:
    """The shard of each of ``keys``: consecutive pages of a chain right after ``prefix``
    (the chain's names before them, from its first page; ``None``: no chain known, each
    page placed by its own name)."""
    if num_shards == 1:
        return [0] * len(keys)
    return [s[0] for s in chain_replicas(keys, prefix, num_shards, segment_pages)]
