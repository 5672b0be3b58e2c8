"""Ray actors hosting the workers: each actor *is* its worker (a subclass that adds only
what Ray needs: the process setup, the number of return values, fetching the handoff), and
small builder functions.

The prompt's KV leaves the prefill actor as the second return value of ``prefill`` (a
task's return value is owned by the caller, so it outlives nothing it should not), and
reaches the decode actor as an ObjectRef nested in a list, so that the decode actor
fetches it itself and can time the handoff. With ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``
in every actor's environment the fetched tensor is a zero-copy view of shared memory,
which the decode worker copies before use.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import ray
import torch

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.request import Req
from pd_cache.core.sealing import Keyring, KeyState
from pd_cache.core.wire import DecodeInfo, PrefillInfo
from pd_cache.worker import key_state
from pd_cache.worker.cores import CoreLedger, Cores
from pd_cache.worker.outputs import Answered, PrefillResult
from pd_cache.worker.workers import DecodeWorker, PrefillWorker

log = logging.getLogger(__name__)

# NOTE: PYTHONMALLOC: the HTTP front runs with glibc's malloc (deployments/serve_config.yaml:
# a burst's memory can then be trimmed); the workers keep CPython's own allocator, with which
# their speed is measured (an actor's runtime_env wins over the env it inherits).
# OMP_WAIT_POLICY: a forward's extra threads sleep between parallel regions instead of
# spinning; a forward that borrowed a core (worker.cores) and lost it to another worker
# would otherwise burn it (zero-reuse TTFT at 4 req/s 0.74x of no lending with it, 1.31x
# without: benchmarks/bench_cores.py).
ACTOR_ENV = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "OMP_NUM_THREADS": "1",
             "OMP_WAIT_POLICY": "PASSIVE", "PYTHONMALLOC": "pymalloc"}
DECODE_CONCURRENCY = 64   # decode calls one batching actor takes in at once
RESERVE_WAIT_S = 2.0      # how long a computed prompt waits for decode's reservation
ActorOptions = dict[str, Any]


def _storage_client(handles: Sequence[Any], config: PDCacheConfig,
                    timeout_s: float | None, metrics: Any, keyring: Keyring | None) -> Any:
    """The worker's L3: the shards' client behind the seal (``keyring``: the cluster's;
    ``None``: a random one, which no other worker shares)."""
    if not handles or not config.storage.enabled:
        return None
    from pd_cache.storage.arena_writer import ArenaWriter
    from pd_cache.storage.client import StorageClient
    from pd_cache.storage.replicas import sharded_client
    from pd_cache.storage.seal import SCRATCH_BYTES, SealedStorage, Sealer
    from pd_cache.storage.tier import resolve

    client = sharded_client(resolve(handles), config.storage.replicas,
                            algo=config.cache.hash_algo, timeout_s=timeout_s, metrics=metrics,
                            segment_pages=config.storage.segment_pages)
    sealer = Sealer(keyring or Keyring.random(), enabled=config.storage.seal)
    # NOTE: an arena slot belongs to one shard; with several copies a set goes by the object
    # store (one put, read by every copy).
    arena = ArenaWriter(client) if isinstance(client, StorageClient) else None
    return SealedStorage(client, sealer, metrics, scratch_bytes=SCRATCH_BYTES, arena=arena)


def _in_process(config: PDCacheConfig, storage_handles: Sequence[Any], threads: int,
                storage_timeout_s: float | None, keyring: Keyring | None) -> dict[str, Any]:
    """Set up the actor's process and make what its worker takes from it: one metrics
    recorder (worker and L3 client share it) and the L3 client."""
    from pd_cache.metrics import PDCacheMetrics

    torch.set_num_threads(threads)
    # NOTE: both warnings concern tensors shared zero-copy through the object store: the
    # pages prefill returns are never written after return, and decode copies what it
    # receives before use.
    warnings.filterwarnings("ignore", message=".*[Zz]ero-copy tensor.*")
    warnings.filterwarnings("ignore", message=".*non-writable tensors.*")
    metrics = PDCacheMetrics("auto")
    return {"metrics": metrics,
            "storage": _storage_client(storage_handles, config, storage_timeout_s, metrics,
                                       keyring),
            "storage_timeout_s": storage_timeout_s or 30.0}


class _Hosted:
    """What an actor adds to the worker it is: answers to health checks, and its L3 keys
    (``core.sealing``) with the namespaces each tenant used here (what a purge drops).
    Every other call (``flush``, ``state``, ``drop_cache``, ...) is the worker's own."""

    worker_id: int
    keyring: Keyring
    _seeds: dict[str, set[bytes]]

    def _host(self, keyring: Keyring | None) -> Keyring:
        # NOTE: the cluster's state now, not the one this actor was first given: a
        # restarted worker reads and writes under the keys its peers use (key_state).
        self.keyring, self._seeds = key_state.refreshed(keyring or Keyring.random()), {}
        return self.keyring

    def _publish(self, index: Sequence[Any]) -> None:
        """Tell the page index (its shards ``index``) what enters and leaves L1 and L2."""
        from pd_cache.storage.tier import publish_events

        cache = self.engine.cache
        self.events = publish_events(f"{self.role}-{self.worker_id}", cache, cache.held, index)

    def _lend(self, threads: int, lend: bool) -> None:
        """With ``lend``, a prompt's forward borrows the cores the node's other workers
        leave idle (``worker.cores``); else every forward keeps ``threads``."""
        node = ray.get_runtime_context().get_node_id()
        ledger = CoreLedger.open(node, base=threads) if lend else None
        self.engine.cores = Cores(ledger, self.engine.stats, self.engine.model.blocks)

    def _saw(self, req: Req) -> None:
        self._seeds.setdefault(req.tenant, set()).add(req.namespace_seed(self.algo))

    def set_keys(self, state: KeyState) -> None:
        """The cluster's new key state (a rotation, a retirement, a purge)."""
        self.keyring.state = state

    def owner(self, tenant: str) -> bytes:
        """``tenant``'s owner label on sealed records (what a shard reclaims by)."""
        return self.keyring.owner(tenant)

    def forget_tenant(self, tenant: str) -> int:
        """Drop the L1 and L2 pages of every namespace ``tenant`` used here; how many."""
        return self.drop_namespaces(self._seeds.pop(tenant, set()))

    def ready(self) -> int:
        return self.worker_id

    def pid(self) -> int:
        """The hosting process id (changes when the actor restarts)."""
        return os.getpid()


class PrefillActor(_Hosted, PrefillWorker):
    def __init__(self, config: PDCacheConfig, worker_id: int, storage_handles: Sequence[Any],
                 threads: int = 1, storage_timeout_s: float | None = 10.0,
                 keyring: Keyring | None = None, index: Sequence[Any] = (),
                 hold_s: float = 0.0, lend_cores: bool = False) -> None:
        super().__init__(config, worker_id=worker_id, **_in_process(
            config, storage_handles, threads, storage_timeout_s, self._host(keyring)))
        self.algo, self.hold_s = config.cache.hash_algo, hold_s
        self._lend(threads, lend_cores)
        self._publish(index)

    @ray.method(num_returns=3)
    def prefill(self, req: Req, kept_pages: int | list[Any] = 0,
                l3_pages: int | None = None) -> PrefillResult:
        """-> info, the prompt's KV pages after the ``kept_pages`` decode holds, a hybrid
        prompt's states (``None`` when plain), as three objects. ``kept_pages`` may be a
        decode worker's ``reserve`` call (its ref in a list), awaited once the prompt is
        computed."""
        result, after = self._first(req, kept_pages, l3_pages)
        after()
        return result

    @ray.method(num_returns="streaming")
    def prefill_stream(self, req: Req, kept_pages: int | list[Any] = 0,
                       l3_pages: int | None = None) -> Iterator[Any]:
        """``prefill``'s three objects as a stream, in that order: the info (the first
        token) goes back as soon as it is drawn, before the KV is stored for decode; the
        L3 write-through and the metrics follow once all three are on their way (so the
        call's end, ``completed()``, says the KV is stored)."""
        result, after = self._first(req, kept_pages, l3_pages)
        info, *rest = result
        yield info
        if self.hold_s:   # NOTE: fault injection (ClusterConfig.prefill_hold_s), 0 in service
            time.sleep(self.hold_s)
        for item in rest:   # NOTE: not ``yield from``: Ray sends into the generator
            yield item
        after()

    def _first(self, req: Req, kept_pages: int | list[Any],
               l3_pages: int | None) -> Answered:
        self._saw(req)
        if isinstance(kept_pages, list):
            kept_pages = functools.partial(_reserved, kept_pages[0], req.rid)
        return self.prefill_first(req, kept_pages, l3_pages)


def _reserved(ref: Any, rid: str) -> int:
    """What a decode worker's ``reserve`` answered; 0 (a full handoff) if it failed (the
    worker died) or is still not back after ``RESERVE_WAIT_S``."""
    try:
        return ray.get(ref, timeout=RESERVE_WAIT_S)
    except Exception as e:  # noqa: BLE001 - any failure: decode gets the whole prompt
        log.warning("request %s: decode's reservation failed (%s); a full handoff", rid,
                    type(e).__name__)
        return 0


class DecodeActor(_Hosted, DecodeWorker):
    """A threaded actor (``max_concurrency``): each ``decode_handoff`` call waits on its own
    thread while the worker's batcher runs the steps of every call in flight together."""

    def __init__(self, config: PDCacheConfig, worker_id: int, storage_handles: Sequence[Any],
                 threads: int = 1, storage_timeout_s: float | None = 10.0,
                 max_batch: int = 1, keyring: Keyring | None = None,
                 index: Sequence[Any] = (), lend_cores: bool = False) -> None:
        super().__init__(config, worker_id=worker_id, max_batch=max_batch, **_in_process(
            config, storage_handles, threads, storage_timeout_s, self._host(keyring)))
        self.algo = config.cache.hash_algo
        self._lend(threads, lend_cores)
        self._publish(index)

    def decode_handoff(self, req: Req, info: PrefillInfo, handoff: list[Any]) -> DecodeInfo:
        """``decode`` of the pages (and a hybrid prompt's states) ``handoff`` refers to."""
        *_, result = self.stream_handoff(req, info, handoff)
        return result

    @ray.method(num_returns="streaming")
    def stream_handoff(self, req: Req, info: PrefillInfo,
                       handoff: list[Any]) -> Iterator[int | DecodeInfo]:
        """``decode_stream`` of what ``handoff`` refers to: each token after the first as
        it is drawn, then the ``DecodeInfo``."""
        req.check_deadline("handoff")
        self._saw(req)
        start = time.perf_counter()
        self.expect(req.rid, info.page_names)
        try:
            # NOTE: [pages] or [pages, states] (a hybrid prompt's recurrent state).
            got = ray.get(list(handoff[:2]))
        except BaseException:
            self.hold(req, None, None)
            raise
        states = got[1] if len(got) > 1 else None
        yield from self.decode_stream(req, info, got[0], time.perf_counter() - start, states)


@functools.cache
def _remote(cls: type) -> Any:
    return ray.remote(cls)


def _options(num_cpus: float, max_restarts: int, max_concurrency: int = 1,
             actor: ActorOptions | None = None) -> dict[str, Any]:
    options = {"num_cpus": num_cpus, "max_restarts": max_restarts,
               "max_concurrency": max_concurrency,
               "runtime_env": {"env_vars": dict(ACTOR_ENV)}}
    return {**options, **(actor or {})}


def named(name: str, namespace: str, *, detached: bool = True) -> ActorOptions:
    """Options of a named actor that outlives its creator (``detached``) and is fetched,
    not created again, by whoever asks for the same name (``get_if_exists``)."""
    out: ActorOptions = {"name": name, "namespace": namespace, "get_if_exists": True}
    if detached:
        out["lifetime"] = "detached"
    return out


def prefill_actor(config: PDCacheConfig, worker_id: int, storage_handles: Sequence[Any] = (),
                  *, threads: int = 1, num_cpus: float = 0, max_restarts: int = 0,
                  storage_timeout_s: float | None = 10.0, keyring: Keyring | None = None,
                  actor: ActorOptions | None = None, index: Sequence[Any] = (),
                  hold_s: float = 0.0, lend_cores: bool = False) -> Any:
    """A ``PrefillActor`` handle; ``prefill.remote(req)`` returns ``(info_ref, pages_ref,
    states_ref)`` (states: a hybrid prompt's, ``None`` when plain); ``prefill_stream``
    streams the same three, the info first (what the router uses).

    ``storage_handles``: the L3 shards, as actor handles or, better, as
    ``pd_cache.storage.tier.ShardName`` (looked up by the worker: no handle in its
    constructor's arguments). ``max_restarts`` (-1: always) brings a killed process back;
    its calls are not retried by Ray (the router retries a request elsewhere). ``actor``:
    more Ray actor options (a name, a placement resource, ...). ``keyring``: the cluster's
    L3 keys (every worker of a cluster needs the same; ``None``: this worker's own).
    ``index``: the page index's shards (``ShardName``), told of every page in L1 and L2.
    ``hold_s``: how long ``prefill_stream`` waits between its answer and the KV
    (``ClusterConfig.prefill_hold_s``). ``lend_cores``: a prompt's forward borrows the
    node's idle cores (``pd_cache.worker.cores``)."""
    return _remote(PrefillActor).options(**_options(num_cpus, max_restarts, 1, actor)).remote(
        config, worker_id, list(storage_handles), threads, storage_timeout_s, keyring,
        list(index), hold_s, lend_cores)


def decode_actor(config: PDCacheConfig, worker_id: int, storage_handles: Sequence[Any] = (),
                 *, threads: int = 1, num_cpus: float = 0, max_restarts: int = 0,
                 storage_timeout_s: float | None = 10.0, max_batch: int = 1,
                 keyring: Keyring | None = None, actor: ActorOptions | None = None,
                 index: Sequence[Any] = (), lend_cores: bool = False) -> Any:
    """A ``DecodeActor`` handle; ``decode_handoff.remote(req, info, [pages_ref,
    states_ref])`` -> ``DecodeInfo`` (``[pages_ref]`` alone for a plain model).

    ``max_batch > 1``: up to that many requests decode together; the actor then takes
    more calls at once than it batches (the rest wait in the batcher's queue), as it does
    with a decode cache (``reserve`` calls come while it decodes). Restarts, ``keyring``,
    ``actor``, ``index`` and ``lend_cores`` as for ``prefill_actor``.
    """
    # NOTE: a decode cache answers reservations while a decode call is running.
    serial = max_batch == 1 and not config.cache.decode_cache
    concurrency = 1 if serial else DECODE_CONCURRENCY
    options = _options(num_cpus, max_restarts, concurrency, actor)
    return _remote(DecodeActor).options(**options).remote(
        config, worker_id, list(storage_handles), threads, storage_timeout_s, max_batch,
        keyring, list(index), lend_cores)
