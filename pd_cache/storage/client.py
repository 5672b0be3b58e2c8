"""``StorageClient``: the backend interface over N ``StorageTier`` actors.

A chain's pages go to the shards in segments of consecutive pages, each segment to one
shard by rendezvous hashing of its first page's name (``pd_cache.storage.placement``); a
batch without a chain (no ``ExtraInfo.prefix_keys``) goes page by page. A batch is split
per shard, sent to all of them at once and merged back in key order::

    keys      k0  k1  k2  k3  k4          exists: shard 0 has 1 of [k0 k2 k4] -> stops at k2
    shard     0   1   0   1   0                   shard 1 has 2 of [k1 k3]    -> no stop
    prefix = min over shards of the position where that shard's hits stop = 2

Expected priors are computed here, over the whole batch, and sent with each shard's keys.
A ``memory`` shard answers a get with refs to blocks of records (``storage.shared``),
mapped here in one call and verified before use (``storage.reader``); a record that fails
is a miss and the shard is told to discard it. The misses only a reader sees (a shard that
timed out or failed, a record that did not verify) are counted in the client's ``Stats``
and, in a Ray worker, exported as ``pd_cache_storage_misses_total`` by reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pd_cache.core.config import StorageConfig
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.metrics import PDCacheMetrics, resolve_exporter
from pd_cache.storage.arena import this_node
from pd_cache.storage.base import (
    ExtraInfo,
    Pending,
    PoolHits,
    PoolTransfer,
    ShardFault,
    SubmittedBackend,
    Usage,
)
from pd_cache.storage.batch import Batch, check_batch, normalize_keys, usable_hits
from pd_cache.storage.placement import chain_shards, rendezvous
from pd_cache.storage.reader import Checksummer, Received, count_read, receive, remaining
from pd_cache.storage.record import CHECKPOINT_POOLS

if TYPE_CHECKING:
    from pd_cache.core.config import KVLayout
    from pd_cache.storage.shared import SharedPages

log = logging.getLogger(__name__)

T = TypeVar("T")
Plan = dict[int, list[tuple[int, list[int]]]]  # shard -> [(transfer index, key positions)]
# A step run on each shard's answer once it arrived (with the call's deadline): the
# answer to merge, and a fault if part of it could not be used.
Resolve = Callable[[int, Any, float | None], tuple[Any, ShardFault | None]]


class StorageClient(SubmittedBackend):
    """Spreads pages over tier actors; sync calls wait at most ``timeout_s`` seconds.

    ``handles`` must be in the same order in every process (shard ``i`` is ``handles[i]``).
    A shard that is dead or slower than the timeout never raises and never hangs: its keys
    are misses, counted here by reason (``storage_error`` / ``timeout``), and the
    ``submit_*`` variants list it in :attr:`Pending.faults`.

    Records a shard lends are verified here against ``layout`` (``None``: the shard's);
    received payloads are read-only views of shared memory. ``metrics`` receives the
    misses counted here (default: Ray's, inside a Ray worker). ``verify_threads``: threads
    that checksum a large answer side by side (default: this process's cores, at most 4).
    ``segment_pages``: the placement's segment (every client of the shards must agree).
    """

    # NOTE: every record a shard answers with, lent or sent by value, is verified here
    # (storage.reader.receive): the bytes this process reads are the bytes hashed.
    checksums_in_reader = True

    def __init__(self, handles: Sequence[Any], *, algo: str = "xxh3_128",
                 timeout_s: float | None = 30.0, layout: KVLayout | None = None,
                 metrics: PDCacheMetrics | None = None,
                 verify_threads: int | None = None,
                 segment_pages: int = StorageConfig.segment_pages) -> None:
        if not handles:
            raise ValueError("handles: expected at least one StorageTier actor")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0 or None, got {timeout_s!r}")
        self.handles, self.algo, self.timeout_s = list(handles), algo, timeout_s
        self.layout, self.segment_pages = layout, segment_pages
        self._stats = Stats()
        if metrics is None and resolve_exporter("auto") == "ray":
            metrics = PDCacheMetrics("ray")
        self.metrics = metrics
        self._warned: set[tuple[int, MissReason]] = set()
        self._checksums = Checksummer(verify_threads)
        self.node = this_node()   # NOTE: a shard on this machine lends its arena records

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, *, detached: bool = False,
                    timeout_s: float | None = 30.0, **options: Any) -> StorageClient:
        """Create (or, when named, join) ``config.storage.num_shards`` tier actors."""
        from pd_cache.storage.tier import storage_actors

        return cls(storage_actors(config, name, detached=detached, **options),
                   algo=config.cache.hash_algo, timeout_s=timeout_s, layout=config.layout,
                   segment_pages=config.storage.segment_pages)

    # -- async ------------------------------------------------------------------------------
    def submit_exists_v2(self, transfers: Sequence[PoolTransfer],
                         extra_info: ExtraInfo | None = None) -> Pending[PoolHits]:
        return self._exists(transfers, extra_info, _merge_exists)

    def _exists(self, transfers: Sequence[PoolTransfer], extra_info: ExtraInfo | None,
                merge: Callable[[list[Batch], Plan, dict[int, PoolHits]], T]) -> Pending[T]:
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        if not batches:
            raise ValueError("transfers: name at least one pool")
        plan = self.plan(batches, extra_info)
        refs = {s: self.handles[s].batch_exists_v2.remote(_share(batches, parts), extra_info)
                for s, parts in plan.items()}
        return _FanOut(refs, lambda answers: merge(batches, plan, answers),
                       self._fault_counter(plan, Event.MISS, per_key=False), self.timeout_s)

    def submit_get_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[PoolTransfer]]:
        batches = check_batch(transfers, extra_info, self.algo, with_pages=False)
        plan = self.plan(batches, extra_info)
        refs = {s: self.handles[s].batch_get_shared_v2.remote(_share(batches, parts),
                                                               extra_info, self.node)
                for s, parts in plan.items()}
        merge = _merger(batches, plan, None, lambda b, pages: PoolTransfer(b.pool, b.keys, pages))
        rid = extra_info.request_id if extra_info else None
        return _FanOut(refs, merge, self._fault_counter(plan, Event.MISS), self.timeout_s,
                       resolve=self._receiver(batches, plan, rid))

    def submit_set_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[list[bool]]]:
        # NOTE: every shard's share is checked before any is sent: bad input stores nothing.
        batches = check_batch(transfers, extra_info, self.algo, with_pages=True)
        plan = self.plan(batches, extra_info)
        refs = {s: self.handles[s].batch_set_v2.remote(_share(batches, parts), extra_info)
                for s, parts in plan.items()}
        merge = _merger(batches, plan, False, lambda b, acks: acks)
        return _FanOut(refs, merge, self._fault_counter(plan, Event.REFUSED), self.timeout_s)

    def discard_v2(self, pool: str, keys: Sequence[bytes | str]) -> int:
        """Ask every shard to delete ``keys`` (not waited for: returns 0). Rare, and a
        key alone does not say where its chain's segment lives."""
        keys = normalize_keys(keys, self.algo)
        for handle in self.handles:
            handle.discard_v2.remote(pool, keys)
        return 0

    def reclaim(self, owners: Sequence[bytes] = (), below: int = 0) -> int:
        """Every shard's ``reclaim`` (purged owners, retired versions); records deleted."""
        return sum(self._gather("reclaim", list(owners), below))

    # -- counts -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """This client's fault counts plus every reachable shard's counts."""
        total = Stats()
        total.merge(self._stats.snapshot())
        for snapshot in self._gather("stats"):
            total.merge(snapshot)
        return total.snapshot()

    def usage(self) -> Usage:
        usages = self._gather("usage")
        return Usage(sum(u.records for u in usages), sum(u.bytes for u in usages),
                     sum(u.capacity_bytes for u in usages))

    def _gather(self, method: str, *args: Any) -> list[Any]:
        refs = {s: getattr(h, method).remote(*args) for s, h in enumerate(self.handles)}
        answers = _FanOut(refs, lambda a: a, lambda fault: None, self.timeout_s).result()
        return [answers[s] for s in sorted(answers)]

    # -- routing ----------------------------------------------------------------------------
    def shard_of(self, key: bytes) -> int:
        """The shard of a page written without a chain (no ``prefix_keys``)."""
        return rendezvous(key, len(self.handles))

    def shards_of(self, keys: Sequence[bytes], prefix: Sequence[bytes] | None) -> list[int]:
        """The shard of each page of a chain's run ``keys`` after ``prefix`` (its names
        before them; ``None``: no chain, page by page)."""
        return chain_shards(keys, prefix, len(self.handles), self.segment_pages)

    def plan(self, batches: list[Batch], info: ExtraInfo | None) -> Plan:
        """Which keys each shard gets; a sidecar pool's keys go where their pages' KV goes."""
        prefix = None if info is None or info.prefix_keys is None else \
            normalize_keys(info.prefix_keys, self.algo, "extra_info.prefix_keys")
        op = max(batches, key=lambda b: len(b.keys), default=None)
        shards = [] if op is None else self.shards_of(op.keys, prefix)
        plan: Plan = {}
        for j, b in enumerate(batches):
            positions: dict[int, list[int]] = {}
            for i, key in enumerate(b.keys):
                s = shards[b.start + i] if prefix is not None else self.shard_of(key)
                positions.setdefault(s, []).append(i)
            for s, pos in positions.items():
                plan.setdefault(s, []).append((j, pos))
        return plan

    def _receiver(self, batches: list[Batch], plan: Plan, rid: str | None) -> Resolve:
        """Turns a shard's get answer into verified pages per part of the plan."""
        def resolve(shard: int, answer: list[SharedPages], deadline: float | None
                    ) -> tuple[list[list[Any]], ShardFault | None]:
            out, fault = [], None
            for (j, pos), shared in zip(plan[shard], answer):
                got = receive(shared, [batches[j].keys[i] for i in pos],
                              [batches[j].priors[i] for i in pos],
                              self.layout or shared.layout, self.algo, deadline, rid,
                              self._checksums)
                fault = self._settle(shard, shared.pool, got) or fault
                out.append(got.pages)
            return out, fault
        return resolve

    def _settle(self, shard: int, pool: str, got: Received) -> ShardFault | None:
        """Count what a lent answer cost; ask the shard to drop records that failed."""
        # NOTE: the shard counted every lent key as a hit; what fails here is also counted
        # as a miss, here, so a damaged or lost record shows under its reason.
        if got.bad:
            self._count(Event.MISS, MissReason.VERIFICATION_FAILED, len(got.bad))
            self.handles[shard].discard_v2.remote(pool, got.bad)
        if not got.lost:
            return None
        fault = ShardFault(shard, got.reason, got.detail)
        self._log_fault(fault)
        self._count(Event.MISS, got.reason, got.lost)
        return fault

    def _count(self, event: Event, reason: MissReason, n: int) -> None:
        count_read(self._stats, self.metrics, event, reason, n)

    def _log_fault(self, fault: ShardFault) -> None:
        # NOTE: a dead shard fails every call; say so once per shard and reason.
        first = (fault.shard, fault.reason) not in self._warned
        self._warned.add((fault.shard, fault.reason))
        log.log(logging.WARNING if first else logging.DEBUG, "L3 shard %d: %s (%s)",
                fault.shard, fault.reason.value, fault.detail)

    def _fault_counter(self, plan: Plan, event: Event,
                       per_key: bool = True) -> Callable[[ShardFault], None]:
        def count(fault: ShardFault) -> None:
            self._log_fault(fault)
            n = sum(len(pos) for _, pos in plan[fault.shard]) if per_key else 1
            self._count(event, fault.reason, n)
        return count


def _share(batches: list[Batch], parts: list[tuple[int, list[int]]]) -> list[PoolTransfer]:
    """One shard's part of the batch: its keys, their pages and their expected priors."""
    out = []
    for j, pos in parts:
        b = batches[j]
        pages = None if b.pages is None else [b.pages[i] for i in pos]
        out.append(PoolTransfer(b.pool, [b.keys[i] for i in pos], pages,
                                [b.priors[i] for i in pos]))
    return out


def _merge_exists(batches: list[Batch], plan: Plan, answers: dict[int, PoolHits]) -> PoolHits:
    ends = {b.pool: len(b.keys) for b in batches}
    marks = {b.pool: [False] * len(b.keys) for b in batches if b.pool in CHECKPOINT_POOLS}
    for s, parts in plan.items():
        for j, pos in parts:
            pool = batches[j].pool
            hits = answers[s].per_pool[pool] if s in answers else 0
            if hits < len(pos):
                ends[pool] = min(ends[pool], pos[hits])
            if pool in marks and s in answers:
                for i, ok in zip(pos, (answers[s].checkpoints or {}).get(pool, [])):
                    marks[pool][i] = ok
    return usable_hits(batches, ends, marks)


def _merger(batches: list[Batch], plan: Plan, missing: Any,
            wrap: Callable[[Batch, list[Any]], Any]) -> Callable[[dict[int, Any]], list[Any]]:
    """Merge per-shard lists (pages or acks) back into key order; faulted keys get ``missing``."""
    def merge(answers: dict[int, list[Any]]) -> list[Any]:
        slots = [[missing] * len(b.keys) for b in batches]
        for s, answer in answers.items():
            for (j, pos), part in zip(plan[s], answer):
                values = part.pages if isinstance(part, PoolTransfer) else part
                for i, value in zip(pos, values):
                    slots[j][i] = value
        return [wrap(b, values) for b, values in zip(batches, slots)]
    return merge


class _FanOut(Pending[T], Generic[T]):
    """Calls in flight on several shards; merged into one result on first ``result()``."""

    _UNSET = object()

    def __init__(self, refs: dict[int, Any], merge: Callable[[dict[int, Any]], T],
                 on_fault: Callable[[ShardFault], None], timeout_s: float | None,
                 resolve: Resolve | None = None) -> None:
        self._refs, self._merge, self._on_fault = refs, merge, on_fault
        self._resolve = resolve
        self._timeout_s = timeout_s
        self._faults: list[ShardFault] = []
        self._value: Any = self._UNSET

    def done(self) -> bool:
        import ray

        if self._value is not self._UNSET or not self._refs:
            return True
        refs = list(self._refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    @property
    def faults(self) -> list[ShardFault]:
        return list(self._faults)

    def result(self, timeout: float | None = None) -> T:
        if self._value is self._UNSET:
            self._value = self._merge(self._collect(self._timeout_s if timeout is None
                                                    else timeout))
        return self._value

    def _collect(self, timeout: float | None) -> dict[int, Any]:
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        answers = {}
        # NOTE: one ray.get per shard with what is left of the deadline (not a ray.wait for
        # all first, then the gets): the same bound on the whole call, one round trip less.
        for shard, ref in self._refs.items():
            try:
                answers[shard] = ray.get(ref, timeout=remaining(deadline))
            except ray.exceptions.GetTimeoutError:
                self._fault(shard, MissReason.TIMEOUT, f"no answer within {timeout} s")
                continue
            except ValueError:
                raise  # bad input is the caller's error, not a cache fault
            except ray.exceptions.RayError as e:
                self._fault(shard, MissReason.STORAGE_ERROR, f"{type(e).__name__}: {e}"[:300])
                continue
            if self._resolve is not None:
                answers[shard], fault = self._resolve(shard, answers[shard], deadline)
                if fault is not None:
                    self._faults.append(fault)
        return answers

    def _fault(self, shard: int, reason: MissReason, detail: str) -> None:
        fault = ShardFault(shard, reason, detail)
        self._faults.append(fault)
        self._on_fault(fault)
