"""``rebuild``: give every replica the pages it lacks, now (``PDCluster.rebuild_storage``).

Reads repair what they reach (``storage.replicas``); a shard restarted empty gets the rest
here. The shards' ``kv`` records name their priors, so their union is a forest of chains::

    links   (n0, seed) (n1, n0) (n2, n1) (n3, n1)      chains   n0 n1 n2
                                                                n0 n1 n3

Each chain is asked of every rank (an ``exists``, key by key); the keys a rank lacks and
another holds are read from that one (verified as any read) and stored on it as they are
(the same sealed records). ``bytes_per_s`` caps the copy rate. A page whose
chain lost its head everywhere is placed as if it started there (a wasted copy at worst).
A sidecar pool (a hybrid model's ``state``, kept at some pages of a chain) is asked and
copied the same way, key by key, after the chain's ``kv``: it lives where its page's KV
does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.record import KV_POOL, STATE_POOL
from pd_cache.storage.replica_parts import presence


class Rebuilt(NamedTuple):
    chains: int   # chains checked
    pages: int    # records copied to a replica that lacked them (kv pages, states)
    bytes: int    # their bytes


def chains(links: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, list[bytes]]]:
    """Every maximal chain of ``links`` (``(name, prior)``), from its head: ``(the head's
    prior, names)``; a chain that forks is one per branch."""
    prior_of = dict(links)
    has_child = set(prior_of.values())
    out = []
    for leaf in sorted(n for n in prior_of if n not in has_child):
        names, at, seen = [], leaf, set()
        while at in prior_of and at not in seen:   # NOTE: a cycle is not a chain: cut it
            seen.add(at)
            names.append(at)
            at = prior_of[at]
        out.append((at, names[::-1]))
    return out


def rebuild(client: Any, bytes_per_s: float, pools: Sequence[str] = (KV_POOL,)) -> Rebuilt:
    """Copy to each rank of ``client`` (a ``ReplicatedClient``) what it lacks of every
    chain the shards hold, in ``pools`` (``kv`` first; a hybrid model's: ``state`` too,
    ``pools_of``), at most ``bytes_per_s`` bytes a second."""
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s: expected a number > 0, got {bytes_per_s!r}")
    links = [link for shard in client.primary._gather("links") for link in shard]
    start, pages, sent = time.monotonic(), 0, 0
    found = chains(links)
    for seed, names in found:
        info = ExtraInfo(prefix_keys=[], namespace_seed=seed)
        for pool in pools:
            ask = [PoolTransfer(pool, names)]
            marks = [m[0] for m in [r._exists(ask, info, presence).result()
                                    for r in client.ranks]]
            for dst in range(len(marks)):
                for src, run in copies(marks, dst):
                    copied = _copy(client, src, dst, PoolTransfer(pool, names), run, seed)
                    pages, sent = pages + copied[0], sent + copied[1]
                    _pace(start, sent, bytes_per_s)
    client.settle(wait=True)
    return Rebuilt(len(found), pages, sent)


def pools_of(layout: Any) -> tuple[str, ...]:
    """The pools a rebuild copies for ``layout`` (a ``KVLayout``): ``kv``, and a hybrid
    model's ``state``."""
    return (KV_POOL, STATE_POOL) if layout.has_state else (KV_POOL,)


def copies(marks: list[list[bool]], dst: int) -> list[tuple[int, list[int]]]:
    """The runs of keys rank ``dst`` lacks and another holds (``marks[rank][key]``), each
    with the first rank that holds it: ``(source, positions)``."""
    out: list[tuple[int, list[int]]] = []
    for i, held in enumerate(marks[dst]):
        src = None if held else next((q for q, m in enumerate(marks) if m[i]), None)
        if src is None:
            continue
        if out and out[-1][0] == src and out[-1][1][-1] == i - 1:
            out[-1][1].append(i)
        else:
            out.append((src, [i]))
    return out


def _copy(client: Any, src: int, dst: int, chain: PoolTransfer, run: list[int],
          seed: bytes) -> tuple[int, int]:
    """The records of ``chain``'s pool at positions ``run`` (consecutive) read from rank
    ``src``, stored on rank ``dst``."""
    names, lo, hi = chain.keys, run[0], run[-1] + 1
    info = ExtraInfo(prefix_keys=names[:lo], namespace_seed=seed)
    got = client.ranks[src].batch_get_v2([PoolTransfer(chain.pool, names[lo:hi])], info)
    pages = list(got[0].pages or [])
    n = next((i for i, p in enumerate(pages) if p is None), len(pages))
    if not n:
        return 0, 0
    acks = client.ranks[dst].batch_set_v2([PoolTransfer(chain.pool, names[lo:lo + n],
                                                        pages[:n])], info)
    stored = {k for k, ok in zip(names[lo:lo + n], acks[0]) if ok}
    client.repaired(stored)
    return len(stored), sum(p.nbytes for p in pages[:n])


def _pace(start: float, sent: int, bytes_per_s: float) -> None:
    """Sleep until ``sent`` bytes since ``start`` are within the rate."""
    ahead = sent / bytes_per_s - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(ahead)
