"""The actors of a ``PDCluster``: created (``ray.init()`` first if need be) and waited for,
or, for a name already taken, attached to (``PDCluster.start``)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from pd_cache.cluster.operations import NAMESPACE
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.sealing import Keyring, cluster_keyring


class Launched(NamedTuple):
    prefill: list[Any]
    decode: list[Any]
    storage: list[Any]
    index: list[Any]
    keys: Keyring   # the cluster's keyring, with the key state it goes on with


def launch(config: ClusterConfig, name: str | None, secret: bytes | None) -> Launched:
    """The actors of a cluster of ``config``; named and detached with ``name``; their L3
    keys derive from ``secret`` (``pd_cache.core.sealing.cluster_keyring``)."""
    import ray

    from pd_cache.cluster.index import index_actors, index_bound
    from pd_cache.model.digest import with_weights_digest
    from pd_cache.storage.tier import ShardName, storage_actors
    from pd_cache.worker import key_state
    from pd_cache.worker.actors import decode_actor, prefill_actor

    if not isinstance(config, ClusterConfig):
        raise ValueError(f"config: expected ClusterConfig, got {type(config).__name__}")
    if not ray.is_initialized():
        ray.init()
    # NOTE: the weights digest is pinned once, here: the storage shards (no model) read
    # it from the config to partition L3, and each worker checks its own weights match.
    pd = with_weights_digest(config.pd_config)
    named = _namer(name)
    # NOTE: storage shards are named even in a cluster without a name (a unique one,
    # not detached), so workers are told their names, not handles (see ShardName).
    base = name or f"pd-cache-{os.urandom(6).hex()}"
    shards, at = f"{base}/storage", f"{base}/index"
    index = index_actors(config.index_shards, index_bound(config), at, NAMESPACE,
                         detached=bool(name)) if config.cache else []
    index_names = [ShardName(f"{at}-{i}", NAMESPACE) for i in range(len(index))]
    # NOTE: a cluster attached by name goes on with the key state it saved.
    keyring = key_state.refreshed(cluster_keyring(secret, f"{base}/keys"))
    key_state.save(f"{base}/keys", keyring.state)
    storage = (storage_actors(pd, shards, detached=bool(name), namespace=NAMESPACE,
                              max_restarts=config.storage_restarts, index=index_names)
               if config.with_storage else [])
    shard_names = [ShardName(f"{shards}-{i}", NAMESPACE) for i in range(len(storage))]
    opts = {"threads": config.threads, "lend_cores": config.lend_cores,
            "num_cpus": config.actor_cpus,
            "keyring": keyring,
            "storage_timeout_s": config.storage_timeout_s,
            "max_restarts": config.worker_restarts, "index": index_names}
    prefill = [prefill_actor(pd, i, shard_names, actor=named("prefill", i),
                             hold_s=config.prefill_hold_s, **opts)
               for i in range(config.num_prefill)]
    decode = [decode_actor(pd, i, shard_names, max_batch=config.decode_batch,
                           actor=named("decode", i), **opts)
              for i in range(config.num_decode)]
    ray.get([a.ready.remote() for a in prefill + decode] + [s.ping.remote() for s in storage])
    return Launched(prefill, decode, storage, index, keyring)


def _namer(name: str | None) -> Any:
    from pd_cache.worker.actors import named

    def options(role: str, i: int) -> dict[str, Any] | None:
        return named(f"{name}/{role}-{i}", NAMESPACE) if name else None
    return options
