"""``ReplicatedClient``: L3 with ``storage.replicas`` R > 1 copies of every page.

A segment's replica set is its top R shards in rendezvous order, on distinct nodes where
the shards sit on several (``placement.replica_set``). The client is R ``RankClient``\\ s
over the same shards, rank ``r`` placing each page on the ``r``-th shard of its set; each
is a plain ``StorageClient`` (the shard calls and their faults are its own)::

    set     every rank at once; acknowledged per page as soon as one rank stored it, the
            others followed up later (counted; a copy that failed is under-replicated)
    exists  every rank at once; a page is held if one rank holds it
    get     rank 0; what it missed (or failed to verify) from rank 1 once rank 0 answered,
            and so on; a page a later rank served is written back to the earlier ranks that
            lacked it, in the background (a repair); a page that fails a check above the
            client (a seal that does not open) is dropped by its copy and read on the same
            way (``reject`` of the get's result)

So a memory shard restarted empty refills lazily, from the reads that reach it; and
eagerly with ``PDCluster.rebuild_storage`` (``storage.rebuild``). A purge, a key retirement
and a discard reach every shard already (``StorageClient.reclaim`` and ``discard_v2`` ask
them all), and each replica is a record of its own in its shard's quota and page index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pd_cache.core.stats import Stats
from pd_cache.storage.base import (
    ExtraInfo,
    Pending,
    PoolHits,
    PoolTransfer,
    ShardFault,
    SubmittedBackend,
    Usage,
)
from pd_cache.storage.batch import check_batch, normalize_keys
from pd_cache.storage.client import StorageClient
from pd_cache.storage.placement import chain_replicas, replica_set
from pd_cache.storage.replica_parts import (
    AllOf,
    Part,
    ReplicaRead,
    joined_hits,
    part_call,
    parts,
    presence,
)

log = logging.getLogger(__name__)

MAX_TRAILING = 256   # follower writes and repairs in flight before the oldest are waited for


class RankClient(StorageClient):
    """A ``StorageClient`` that places each page on the ``rank``-th shard of its set."""

    def __init__(self, handles: Sequence[Any], *, rank: int, replicas: int,
                 nodes: Sequence[str] | None, **options: Any) -> None:
        super().__init__(handles, **options)
        self.rank, self.replicas, self.nodes = rank, replicas, nodes

    def shard_of(self, key: bytes) -> int:
        return replica_set(key, len(self.handles), self.replicas, self.nodes)[self.rank]

    def shards_of(self, keys: Sequence[bytes], prefix: Sequence[bytes] | None) -> list[int]:
        return [s[self.rank] for s in chain_replicas(
            keys, prefix, len(self.handles), self.segment_pages, self.replicas, self.nodes)]

    def discard_placed(self, transfers: Sequence[PoolTransfer],
                       extra_info: ExtraInfo | None) -> None:
        """Ask the shard this rank places each page on (only that one) to delete it."""
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        for s, shard_parts in self.plan(batches, extra_info).items():
            for j, pos in shard_parts:
                self.handles[s].discard_v2.remote(batches[j].pool,
                                                  [batches[j].keys[i] for i in pos])


class ReplicatedClient(SubmittedBackend):
    """``replicas`` copies of every page over ``handles`` (see the module docstring).

    ``nodes[s]``: the node shard ``s`` runs on (every client of the shards must be given
    the same list; ``None``: ask the shards, ``shard_nodes``). ``options``: as
    ``StorageClient``'s. ``counts()`` says what the replicas cost and repaired.
    """

    checksums_in_reader = True

    def __init__(self, handles: Sequence[Any], *, replicas: int,
                 nodes: Sequence[str] | None = None, **options: Any) -> None:
        if not 1 <= replicas <= len(handles):
            raise ValueError(f"replicas: expected 1 <= replicas <= {len(handles)} shards, "
                             f"got {replicas!r}")
        self.nodes = list(nodes) if nodes is not None else shard_nodes(handles)
        if len(self.nodes) != len(handles):
            raise ValueError(f"nodes: {len(self.nodes)} nodes for {len(handles)} shards")
        if replicas > 1 and len(set(self.nodes)) < min(replicas, len(handles)):
            log.warning("L3: %d replicas over %d node(s): some copies share a node (one "
                        "node's loss loses them)", replicas, len(set(self.nodes)))
        self.ranks = [RankClient(handles, rank=r, replicas=replicas, nodes=self.nodes,
                                 **options) for r in range(replicas)]
        self.primary = self.ranks[0]
        self.algo, self.metrics = self.primary.algo, self.primary.metrics
        self._counts = Stats()
        self._under: set[bytes] = set()
        self._trailing: list[tuple[Pending[list[list[bool]]], list[list[bytes]], bool]] = []
        self._lock = threading.Lock()

    # -- calls ------------------------------------------------------------------------------
    def submit_exists_v2(self, transfers: Sequence[PoolTransfer],
                         extra_info: ExtraInfo | None = None) -> Pending[PoolHits]:
        self.settle()
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        return AllOf([r._exists(transfers, extra_info, presence) for r in self.ranks],
                    lambda each: joined_hits(batches, each))

    def submit_get_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[PoolTransfer]]:
        self.settle()
        first = self.primary.submit_get_v2(transfers, extra_info)
        # NOTE: the later ranks are asked only for what rank 0 missed, once it answered: a
        # hit costs one call, as with one copy (an exists sent to them at once, so that a
        # page no copy holds cost no second round trip, made a read 1.29x one copy's); a
        # page index keeps reads to what L3 holds, so the second round trip is rare.
        return _ReadOn(first, lambda got, timeout: self._read_on(got, extra_info, timeout),
                       self._reject)

    def submit_set_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[list[bool]]]:
        self.settle()
        calls = [r.submit_set_v2(transfers, extra_info) for r in self.ranks]
        keys = [normalize_keys(t.keys, self.algo) for t in transfers]
        with self._lock:
            self._trailing += [(c, keys, False) for c in calls]
        return _FirstAck(calls)

    def discard_v2(self, pool: str, keys: Sequence[bytes | str]) -> int:
        return self.primary.discard_v2(pool, keys)   # every shard is asked

    def reclaim(self, owners: Sequence[bytes] = (), below: int = 0) -> int:
        return self.primary.reclaim(owners, below)   # every shard is asked

    def stats(self) -> dict[str, int]:
        total = Stats()
        total.merge(self.primary.stats())
        for r in self.ranks[1:]:
            total.merge(r._stats.snapshot())
        return total.snapshot()

    def usage(self) -> Usage:
        return self.primary.usage()

    # -- replicas ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Copies written (``copies_stored``, ``copies_refused``), repairs sent and stored,
        and the pages this client knows to lack a copy (``under_replicated``)."""
        self.settle()
        out = {k.partition("/")[0]: n for k, n in self._counts.snapshot().items()}
        with self._lock:
            out["under_replicated"] = len(self._under)
        return out

    def settle(self, wait: bool = False) -> None:
        """Collect the writes of copies and repairs that finished (all of them: ``wait``); a
        copy refused (or on a shard that failed) makes its page under-replicated."""
        with self._lock:
            # NOTE: past MAX_TRAILING writes in flight (a shard that hangs), the oldest are
            # waited for (each at most the client's timeout): the list stays bounded.
            over = len(self._trailing) - MAX_TRAILING
            todo, left = [], []
            for at, t in enumerate(self._trailing):
                (todo if wait or at < over or t[0].done() else left).append(t)
            self._trailing = left
        for pending, keys, repair in todo:
            acks = pending.result()
            stored = {k for ks, a in zip(keys, acks) for k, ok in zip(ks, a) if ok}
            lost = {k for ks, a in zip(keys, acks) for k, ok in zip(ks, a) if not ok}
            if repair:
                self.repaired(stored)
            else:
                self._counts.count("copies_stored", n=len(stored))
                self._counts.count("copies_refused", n=len(lost))
            if not repair:
                self._mark(add=lost - stored, drop=set())

    def repaired(self, keys: set[bytes]) -> None:
        """Count the pages ``keys`` written back to a replica that lacked them."""
        self._counts.count("repaired", n=len(keys))
        if self.metrics is not None and keys:
            self.metrics.count_repairs(len(keys))
        self._mark(add=set(), drop=keys)

    def _mark(self, add: set[bytes], drop: set[bytes]) -> None:
        with self._lock:
            self._under |= add
            self._under -= drop
            n = len(self._under)
        if self.metrics is not None and (add or drop):
            self.metrics.set_under_replicated(n)

    def _read_on(self, got: list[PoolTransfer], info: ExtraInfo | None,
                 timeout: float | None) -> ReplicaRead:
        """``got`` (rank 0's answer) completed from the later ranks (each asked for what
        the ranks before it missed), and the earlier ranks repaired from what the later ones
        served."""
        read = ReplicaRead(got, info)
        self._fill(read, read.missed(), timeout)
        return read

    def _reject(self, read: ReplicaRead, bad: Sequence[Sequence[bool]],
                timeout: float | None) -> list[PoolTransfer]:
        """The pages ``bad`` of ``read`` failed above this client (a seal that does not
        open): each is dropped by the copy that served it and by the earlier ones this read
        repaired from it, then read from the ranks after it (and repaired as a miss).
        Returns the new pages of those keys (``None``: no later copy had one)."""
        floor = read.rejected(bad)
        for dst, rank in enumerate(self.ranks):
            drop = [[f is not None and f >= dst for f in fs] for fs in floor]
            for part in parts(read.got, drop, read.chained):
                rank.discard_placed(*part_call(read.got, part, read.info))
        self._counts.count("copies_rejected", n=sum(f is not None for fs in floor for f in fs))
        self._fill(read, floor, timeout)
        return read.answer(floor)

    def _fill(self, read: ReplicaRead, floor: list[list[int | None]],
              timeout: float | None) -> None:
        """Ask each rank in turn for the keys of ``floor`` still missing, then write what a
        later rank served back to the earlier ones."""
        for r, rank in enumerate(self.ranks[1:], start=1):
            asked = parts(read.got, read.asked(floor, r), read.chained)
            calls = [rank.submit_get_v2(*part_call(read.got, p, read.info)) for p in asked]
            for part, call in zip(asked, calls):
                for i, page in zip(part.positions, call.result(timeout)[0].pages or []):
                    if page is not None and read.pages[part.j][i] is None:
                        read.pages[part.j][i], read.served[part.j][i] = page, r
        for dst, rank in enumerate(self.ranks[:-1]):
            for part in parts(read.got, read.filled(floor, dst), read.chained):
                self._send_repair(rank, read.got, part, read.pages[part.j], read.info)

    def _send_repair(self, rank: RankClient, got: list[PoolTransfer], part: Part,
                     pages: list[Any], info: ExtraInfo | None) -> None:
        keys = [list(got[part.j].keys[i] for i in part.positions)]
        self._mark(add=set(keys[0]), drop=set())
        self._counts.count("repairs_sent", n=len(part.positions))
        pending = rank.submit_set_v2(*part_call(got, part, info, pages))
        with self._lock:
            self._trailing.append((pending, keys, True))


def sharded_client(handles: Sequence[Any], replicas: int = 1,
                   nodes: Sequence[str] | None = None, **options: Any) -> StorageClient | Any:
    """The client over ``handles``: a ``StorageClient``, or with ``replicas`` > 1 a
    ``ReplicatedClient`` (``options``: ``StorageClient``'s)."""
    if replicas == 1:
        return StorageClient(handles, **options)
    return ReplicatedClient(handles, replicas=replicas, nodes=nodes, **options)


def shard_nodes(handles: Sequence[Any], timeout_s: float = 30.0) -> list[str]:
    """The node each shard runs on (``StorageTier.node``); a shard that does not answer is
    a node of its own."""
    import ray

    out = []
    for s, handle in enumerate(handles):
        try:
            out.append(ray.get(handle.node.remote(), timeout=timeout_s))
        except ray.exceptions.RayError:
            out.append(f"shard-{s}")
    return out


class _ReadOn(Pending[list[PoolTransfer]]):
    """Rank 0's get, completed from the later ranks when collected (``read_on``); pages that
    fail above the client go to the next copy with :meth:`reject`."""

    def __init__(self, first: Pending[list[PoolTransfer]],
                 read_on: Callable[[list[PoolTransfer], float | None], ReplicaRead],
                 reject: Callable[[ReplicaRead, Sequence[Sequence[bool]], float | None],
                                  list[PoolTransfer]]) -> None:
        self._first, self._read_on, self._reject = first, read_on, reject
        self._read: ReplicaRead | None = None

    def done(self) -> bool:
        return self._read is not None or self._first.done()

    def result(self, timeout: float | None = None) -> list[PoolTransfer]:
        return self._collected(timeout).answer()

    def _collected(self, timeout: float | None) -> ReplicaRead:
        if self._read is None:
            self._read = self._read_on(self._first.result(timeout), timeout)
        return self._read

    def reject(self, bad: Sequence[Sequence[bool]],
               timeout: float | None = None) -> list[PoolTransfer]:
        """Per pool and key of the result, ``bad``: the page failed a check above this
        client. Each is read from the copies after the one that served it, which drops it
        (a later copy repairs it). The result's transfers with only those keys' pages (the
        next copy's, ``None`` where none had it); the rest ``None``."""
        return self._reject(self._collected(timeout), bad, timeout)

    @property
    def faults(self) -> list[ShardFault]:
        return self._first.faults


class _FirstAck(Pending[list[list[bool]]]):
    """A set on every rank: a page is acknowledged once one rank stored it. Rank 0's answer
    is waited for, the others only where it refused a page (the client collects every
    rank's answer later: ``ReplicatedClient.settle``)."""

    def __init__(self, calls: list[Pending[list[list[bool]]]]) -> None:
        self._calls = calls
        self._value: list[list[bool]] | None = None

    def done(self) -> bool:
        return self._value is not None or self._calls[0].done()

    def result(self, timeout: float | None = None) -> list[list[bool]]:
        if self._value is not None:
            return self._value
        acks = [list(a) for a in self._calls[0].result(timeout)]
        for call in self._calls[1:] if not all(all(a) for a in acks) else ():
            acks = [[x or y for x, y in zip(a, b)] for a, b in zip(acks, call.result(timeout))]
        self._value = acks
        return acks

    @property
    def faults(self) -> list[ShardFault]:
        return self._calls[0].faults
