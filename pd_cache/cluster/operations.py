"""What operators and tests ask a running ``PDCluster``: names, writes, states, stats, and
the way down (``shutdown``, ``destroy``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pd_cache.cluster.keys import ClusterKeys
from pd_cache.cluster.router import PrefixRouter
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.config import PDCacheConfig
from pd_cache.core.request import Req
from pd_cache.core.wire import PageNames, TenantPins, WorkerState
from pd_cache.worker import key_state

NAMESPACE = "pd-cache"   # the Ray namespace of named (detached) clusters


class ClusterOperations(ClusterKeys):
    """Operator views of the actors a ``PDCluster`` holds (``prefill``, ``decode``,
    ``storage``), and its L3 keys (``ClusterKeys``); mixed into ``PDCluster``."""

    config: ClusterConfig
    pd: PDCacheConfig
    prefill: list[Any]
    decode: list[Any]
    storage: list[Any]
    index_actors: list[Any]
    mirror: Any   # this front's IndexMirror, or None
    prefill_router: PrefixRouter
    decode_router: PrefixRouter

    def router_names(self, req: Req) -> list[bytes]:
        raise NotImplementedError

    def page_names(self, req: Req) -> PageNames:
        """The request's prompt page names from the router, every worker and every shard."""
        import ray

        prefill = [a.page_names.remote(req) for a in self.prefill]
        decode = [a.page_names.remote(req) for a in self.decode]
        tiers = [s.page_names.remote(req) for s in self.storage]
        return PageNames(self.router_names(req), ray.get(prefill), ray.get(decode),
                         ray.get(tiers))

    def storage_client(self, timeout_s: float | None = None) -> Any:
        """A client over this cluster's tier actors (``None`` without L3)."""
        from pd_cache.storage.replicas import sharded_client

        if not self.storage:
            return None
        return sharded_client(self.storage, self.pd.storage.replicas,
                              algo=self.pd.cache.hash_algo,
                              timeout_s=timeout_s or self.config.storage_timeout_s,
                              segment_pages=self.pd.storage.segment_pages)

    def rebuild_storage(self, bytes_per_s: float = 64e6) -> dict[str, int]:
        """Copy to every L3 replica the pages it lacks (a shard restarted empty; a hybrid
        model's states too), at most ``bytes_per_s`` a second (``storage.rebuild``); chains
        checked, records and bytes copied. Nothing to do with one copy of each page
        (``storage_replicas`` 1)."""
        from pd_cache.storage.rebuild import pools_of, rebuild

        client = self.storage_client()
        if client is None or self.pd.storage.replicas == 1:
            return {"chains": 0, "pages": 0, "bytes": 0}
        return rebuild(client, bytes_per_s, pools_of(self.pd.layout))._asdict()

    def pins(self, tenant: str) -> TenantPins:
        """``tenant``'s pinned pages on every worker and L3 shard (shards know it by its
        owner label: records sealed without one, with sealing off, are no tenant's)."""
        import ray

        owner = self._owner(tenant)
        workers = [a.pins.remote(tenant) for a in self.prefill + self.decode]
        tiers = [s.pins.remote(owner) for s in self.storage]
        names: set[str] = set()
        latest, held = 0.0, {"workers": 0, "storage": 0}
        for pages in ray.get(workers):
            names.update(p.name.hex() for p in pages)
            latest = max([latest, *(p.expires_in_s for p in pages)])
            held["workers"] += len(pages)
        for listing in ray.get(tiers):
            names.update(listing["names"])
            latest = max(latest, listing["expires_in_s"])
            held["storage"] += len(listing["names"])
        return TenantPins(sorted(names), len(names) * self.pd.layout.page_nbytes, latest,
                          held["workers"], held["storage"])

    def drop_pins(self, tenant: str) -> int:
        """Unpin ``tenant``'s pages on every worker and shard (they stay cached, evictable
        again); how many pins went."""
        import ray

        owner = self._owner(tenant)
        return sum(ray.get([a.drop_pins.remote(tenant) for a in self.prefill + self.decode]
                           + [s.drop_pins.remote(owner) for s in self.storage]))

    def _owner(self, tenant: str) -> str:
        """``tenant``'s owner label on sealed L3 records, hex (a worker knows it)."""
        import ray

        if not self.storage or not self.pd.storage.seal:
            return ""
        return ray.get(self.prefill[0].owner.remote(tenant)).hex()

    def flush(self) -> None:
        """Wait until every worker's background L3 writes so far have finished."""
        import ray

        ray.get([a.flush.remote() for a in self.prefill + self.decode])

    def drop_caches(self) -> dict[str, int]:
        """Empty every cache tier: each worker's L1 and L2 and every L3 shard, after the
        background writes so far have landed (so none arrives after the drop). Pages held
        by requests in flight stay. Returns the pages dropped by tier.

        An operator's reset, e.g. between a benchmark's warm-up and its measurement; not to
        be confused with ``flush``, which only waits for writes and drops nothing.
        """
        import ray

        self.flush()
        out = {"device": 0, "host": 0, "storage": 0}
        for dropped in ray.get([a.drop_cache.remote() for a in self.prefill + self.decode]):
            for tier, n in dropped.items():
                out[tier] += n
        out["storage"] = sum(ray.get([s.drop_all.remote() for s in self.storage]))
        self.prefill_router.forget()
        self.decode_router.forget()
        return out

    def l3_writes(self) -> dict[str, int]:
        """Pages stored in L3 so far (after ``flush``): ``backup`` by prefill write-through,
        ``offload`` by decode."""
        import ray

        out = {"backup": 0, "offload": 0}
        for writes in ray.get([a.l3_writes.remote() for a in self.prefill + self.decode]):
            for kind, n in writes.items():
                out[kind] += n
        return out

    def l3_holds(self, names: Sequence[bytes]) -> int:
        """How many of a prompt's page ``names`` (its chain from the first page, as
        ``router_names`` gives them), from the first, L3 holds (0 without L3)."""
        from pd_cache.storage.base import ExtraInfo

        client = self.storage_client()
        return 0 if client is None else client.batch_exists(list(names),
                                                            ExtraInfo(prefix_keys=[]))

    def l3_calls(self) -> dict[str, int]:
        """Calls the L3 shards answered so far, by op (exists, get, set), as they count."""
        import ray

        out: dict[str, int] = {}
        for calls in ray.get([s.calls.remote() for s in self.storage]):
            for op, n in calls.items():
                out[op] = out.get(op, 0) + n
        return out

    def states(self) -> list[WorkerState]:
        import ray

        return ray.get([a.state.remote() for a in self.prefill + self.decode])

    def engine_stats(self) -> dict[str, dict[str, int]]:
        import ray

        stats = ray.get([a.engine_stats.remote() for a in self.prefill + self.decode])
        roles = [f"prefill-{i}" for i in range(len(self.prefill))] + \
                [f"decode-{i}" for i in range(len(self.decode))]
        return dict(zip(roles, stats))

    def shutdown(self, *, check: bool = True) -> None:
        """Close every worker (with ``check``, raise ``SlotError`` if one leaked a lock or a
        slot) and kill every actor of this cluster."""
        import ray

        if self.mirror is not None:
            self.mirror.stop()
        closing = [a.close.remote() for a in self.prefill + self.decode] if check else []
        try:
            ray.get(closing)
        finally:
            for actor in self.prefill + self.decode + self.storage + self.index_actors:
                ray.kill(actor)
            self.prefill, self.decode, self.storage, self.index_actors = [], [], [], []
            if self.keys_name:
                key_state.drop(self.keys_name)


    @staticmethod
    def destroy(name: str) -> int:
        """Kill every actor of the named cluster ``name`` (how many there were)."""
        import ray

        mine = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NAMESPACE and a["name"].startswith(f"{name}/")]
        for actor_name in mine:
            ray.kill(ray.get_actor(actor_name, namespace=NAMESPACE))
        key_state.drop(f"{name}/keys")
        return len(mine)
