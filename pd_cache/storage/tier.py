"""``StorageTier``: one L3 shard, a plain class wrapping one backend, and its Ray actor.

The logic lives in the backend; the actor only hosts it. Inside Ray the ``memory`` backend
is :class:`~pd_cache.storage.shared.SharedMemoryBackend`, which lends records through the
object store (:meth:`StorageTier.batch_get_shared_v2`) instead of copying them into every
answer. A restarted actor reruns ``__init__``: a ``memory`` shard comes back empty, a
``disk`` shard rebuilds its index from its directory and serves everything it had
acknowledged.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pd_cache.core.config import PDCacheConfig
from pd_cache.core.events import EventLog, Held, Publisher
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import STORAGE_OPS, StorageOp
from pd_cache.storage import make_backend
from pd_cache.storage.arena import Grant
from pd_cache.storage.arena_backend import ArenaBackend
from pd_cache.storage.base import ExtraInfo, PoolHits, PoolTransfer, StorageBackend, Usage
from pd_cache.storage.exporter import StatsExporter
from pd_cache.storage.local import LocalBackend
from pd_cache.storage.shared import SharedMemoryBackend, SharedPages

log = logging.getLogger(__name__)

# NOTE: pages that leave the actor by value travel as uint8 numpy views (see
# PageRecord.__reduce__), which Ray moves zero-copy; the variable extends that to any bare
# tensor an actor returns. PYTHONMALLOC: as the workers (pd_cache/worker/actors.py).
ACTOR_ENV = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "PYTHONMALLOC": "pymalloc"}


class StorageTier:
    """One shard of L3: the backend ``config.storage.backend`` names, for ``config.layout``."""

    def __init__(self, config: PDCacheConfig, shard: int = 0, *,
                 export_stats: bool | None = None, index: Sequence[ShardName] = ()) -> None:
        """``export_stats`` (default: when inside Ray) exports the shard's counts every
        ``config.storage.metrics_interval_s`` (see ``pd_cache.storage.exporter``);
        ``index``: the page index's shards, which this one tells what it stores."""
        if not isinstance(config, PDCacheConfig):
            raise ValueError(f"config: expected PDCacheConfig, got {type(config).__name__}")
        if not 0 <= shard < config.storage.num_shards:
            raise ValueError(f"shard: expected 0 <= shard < {config.storage.num_shards}, "
                             f"got {shard!r}")
        self.shard = shard
        self.backend = tier_backend(config, shard)
        self._calls = Stats()
        self.exporter: StatsExporter | None = None
        if _in_ray() if export_stats is None else export_stats:
            self.exporter = StatsExporter(self.backend.stats, config.storage.backend,
                                          f"shard{shard}", config.storage.metrics_interval_s,
                                          usage=self.backend.usage, calls=self.calls).start()
        held = getattr(self.backend, "held", None)
        self.events = publish_events(f"storage-{shard}", self.backend, held, index) \
            if held is not None else None

    def calls(self) -> dict[str, int]:
        """The calls this shard answered since it started, by op (exists, get, set)."""
        return {op: self._calls.get(op) for op in STORAGE_OPS}

    def batch_exists_v2(self, transfers: Sequence[PoolTransfer],
                        extra_info: ExtraInfo | None = None) -> PoolHits:
        self._calls.count(StorageOp.EXISTS)
        return self.backend.batch_exists_v2(transfers, extra_info)

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        self._calls.count(StorageOp.GET)
        return self.backend.batch_get_v2(transfers, extra_info)

    def batch_get_shared_v2(self, transfers: Sequence[PoolTransfer],
                            extra_info: ExtraInfo | None = None,
                            node: str | None = None) -> list[SharedPages]:
        """``batch_get_v2`` for the client: lent refs if the backend lends, else records
        (``node``: the caller's machine, where an arena record may be lent by reference)."""
        self._calls.count(StorageOp.GET)
        if isinstance(self.backend, ArenaBackend):
            return self.backend.batch_lend_v2(transfers, extra_info, node)
        if isinstance(self.backend, SharedMemoryBackend):
            return self.backend.batch_lend_v2(transfers, extra_info)
        return [SharedPages(t.pool, list(t.pages or []), layout=self.backend.layout)
                for t in self.backend.batch_get_v2(transfers, extra_info)]

    def arena_grant(self, sizes: Sequence[int], node: str, spare: int = 0) -> Grant:
        """Arena slots for records of ``sizes`` bytes, and up to ``spare`` ahead of need
        (``ArenaBackend.arena_grant``)."""
        if not isinstance(self.backend, ArenaBackend):
            return Grant(None, [None] * len(sizes))
        return self.backend.arena_grant(sizes, node, spare)

    def arena_usage(self) -> dict[str, Any]:
        """The arena's slots by state (``{}``: the backend has none)."""
        return self.backend.arena_usage() if isinstance(self.backend, ArenaBackend) else {}

    def discard_v2(self, pool: str, keys: Sequence[bytes]) -> int:
        """Delete records a reader found bad (``StorageBackend.discard_v2``)."""
        return self.backend.discard_v2(pool, keys)

    def reclaim(self, owners: Sequence[bytes] = (), below: int = 0) -> int:
        """Delete purged tenants' and retired keys' records (``LocalBackend.reclaim``)."""
        reclaim = getattr(self.backend, "reclaim", None)
        return 0 if reclaim is None else reclaim(frozenset(owners), below)

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        self._calls.count(StorageOp.SET)
        return self.backend.batch_set_v2(transfers, extra_info)

    def set_quotas(self, quotas: Mapping[bytes, int]) -> None:
        """Bytes each owner label may hold on this shard (``OwnerShares.set_quotas``)."""
        set_quotas = getattr(self.backend, "set_quotas", None)
        if set_quotas is not None:
            set_quotas(quotas)

    def owner_bytes(self) -> dict[bytes, int]:
        """Bytes held per owner label on this shard."""
        owner_bytes = getattr(self.backend, "owner_bytes", None)
        return {} if owner_bytes is None else owner_bytes()

    def drop_all(self) -> int:
        """Delete every record this shard holds (``PDCluster.drop_caches``); how many."""
        clear = getattr(self.backend, "clear", None)
        if clear is None:
            raise ValueError(f"backend {type(self.backend).__name__} cannot be emptied")
        return clear()

    def pins(self, owner: str) -> dict[str, Any]:
        """The records pinned here by ``owner`` (an owner label, hex; ``storage.pinned``)."""
        pins = getattr(self.backend, "pins", None)
        return {"names": [], "bytes": 0, "expires_in_s": 0.0} if pins is None \
            else pins.listing(owner)

    def drop_pins(self, owner: str) -> int:
        """Unpin ``owner``'s records here (they stay stored); how many."""
        pins = getattr(self.backend, "pins", None)
        return 0 if pins is None else len(pins.drop_owner(owner))

    def stats(self) -> dict[str, int]:
        return self.backend.stats()

    def usage(self) -> Usage:
        return self.backend.usage()

    def page_names(self, req: Req) -> list[bytes]:
        """The request's prompt page names as this process computes them (a debug view)."""
        return compute_prefix_hash(req, req.input_ids, page_size=self.backend.layout.page_size,
                                   algo=self.backend.algo)

    def links(self) -> list[tuple[bytes, bytes]]:
        """``(name, prior)`` of every ``kv`` record held here (what ``rebuild_storage``
        finds the chains from)."""
        links = getattr(self.backend, "links", None)
        return [] if links is None else links()

    def node(self) -> str:
        """The Ray node this shard runs on (where its replicas are placed from)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> int:
        """The hosting process id (changes when the actor restarts)."""
        return os.getpid()


def tier_backend(config: PDCacheConfig, shard: int = 0) -> StorageBackend:
    """The shard's backend; in a Ray process, ``memory`` keeps records in an arena and the
    object store (``storage.arena_backend``)."""
    algo = config.cache.hash_algo
    if config.storage.backend != "memory" or not _in_ray():
        backend = make_backend(config.storage, config.layout, algo=algo, shard=shard)
    else:
        backend = ArenaBackend.from_config(config.storage, config.layout, algo=algo,
                                                  shard=shard)
        _warn_if_spilling(backend.capacity_bytes)
    if isinstance(backend, LocalBackend):   # NOTE: no more of the shard pinned than this
        backend.pins.limit(config.cache.max_pinned_fraction)
    return backend


def _in_ray() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _warn_if_spilling(capacity_bytes: int) -> None:
    import ray

    store = ray.cluster_resources().get("object_store_memory", 0)
    if store and capacity_bytes > store:
        # NOTE: still correct (Ray spills objects to disk), but no longer memory speed.
        log.warning("L3 memory shard capacity %d bytes exceeds the object store (%d bytes); "
                    "records will spill to disk", capacity_bytes, int(store))


@functools.cache
def _actor_class() -> Any:
    import ray

    return ray.remote(StorageTier)


def storage_actor(config: PDCacheConfig, name: str | None = None, *, shard: int = 0,
                  detached: bool = False, namespace: str | None = None,
                  max_restarts: int = 3, max_task_retries: int = 1,
                  num_cpus: float = 0, index: Sequence[ShardName] = ()) -> Any:
    """A ``StorageTier`` actor handle for ``shard``.

    Named actors are fetched if they exist (``get_if_exists``), so every process that
    asks for ``name`` shares one shard; ``detached`` outlives the job that created it
    (needs a name). ``max_restarts`` / ``max_task_retries`` make a killed shard come back
    and rerun interrupted calls; batch calls are idempotent, so a retry is safe.
    """
    if detached and not name:
        raise ValueError("name: a detached storage actor needs a name")
    options: dict[str, Any] = {
        "max_restarts": max_restarts, "max_task_retries": max_task_retries,
        "num_cpus": num_cpus, "runtime_env": {"env_vars": dict(ACTOR_ENV)},
    }
    if name:
        options.update(name=name, get_if_exists=True)
        if namespace:
            options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    return _actor_class().options(**options).remote(config, shard, index=list(index))


def storage_actors(config: PDCacheConfig, name: str | None = None, *, detached: bool = False,
                   **options: Any) -> list[Any]:
    """One actor per shard (``config.storage.num_shards``); shard ``i`` is ``{name}-{i}``."""
    return [storage_actor(config, f"{name}-{i}" if name else None, shard=i, detached=detached,
                          **options) for i in range(config.storage.num_shards)]


class ShardName(NamedTuple):
    """A named storage actor, as a worker is told of it: the worker looks it up itself
    (``resolve``), so its constructor holds no actor handle (Ray warns that a restart
    could not rebuild arguments that hold object refs, as handles do)."""

    name: str
    namespace: str | None = None


def resolve(shards: Sequence[Any]) -> list[Any]:
    """Actor handles for ``shards`` (handles, or ``ShardName`` looked up by name)."""
    import ray

    return [ray.get_actor(s.name, namespace=s.namespace) if isinstance(s, ShardName) else s
            for s in shards]


SEND_TIMEOUT_S = 5.0   # an index shard that takes longer gets a snapshot next


def publish_events(publisher: str, journaled: Any, held: Held, index: Sequence[ShardName],
                   flush_s: float = 0.05) -> Publisher | None:
    """Log the KV events of ``journaled`` (its ``journal``) and send them to the page
    index's shards ``index`` every ``flush_s`` off the hot path; ``None`` without an index."""
    if not index:
        return None
    journaled.journal = EventLog()
    handles: list[Any] = [None] * len(index)

    def send(shard: int, batch: Any) -> bool:
        import ray

        if handles[shard] is None:
            handles[shard] = resolve([index[shard]])[0]
        return ray.get(handles[shard].publish.remote(batch), timeout=SEND_TIMEOUT_S)

    return Publisher(publisher, journaled.journal, len(index), send, held, flush_s).start()
