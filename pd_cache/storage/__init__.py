"""L3 storage: verified page records, ``memory`` and ``disk`` backends, sharded tier actors.

Backends come from a small registry with lazy imports (``pd_cache.core.config
.STORAGE_BACKENDS``, which ``StorageConfig.backend`` is checked against): adding one is one
module with a ``LocalBackend`` subclass (or any ``StorageBackend``) and one registry entry. Inside a
Ray process a tier's ``memory`` backend is ``shared.SharedMemoryBackend``, which lends
records to readers through the object store (see ``pd_cache.storage.shared``).
"""

from __future__ import annotations

import importlib
from typing import Any

from pd_cache.core.config import STORAGE_BACKENDS, KVLayout, StorageConfig
from pd_cache.storage.base import (
    ExtraInfo,
    Pending,
    PoolHits,
    PoolTransfer,
    ShardFault,
    StorageBackend,
    Usage,
    usable_prefix,
)
from pd_cache.storage.record import (
    KV_POOL,
    STATE_POOL,
    PageRecord,
    RecordHeader,
    make_record,
    verify,
)

BACKENDS = STORAGE_BACKENDS   # the one registry; ``StorageConfig`` validates against it


def register_backend(name: str, target: str) -> None:
    """Register ``"package.module:Class"`` (a class with ``from_config``) under ``name``."""
    if not name or ":" not in target:
        raise ValueError(f"backend: expected a name and 'module:Class', got {name!r}, "
                         f"{target!r}")
    BACKENDS[name] = target


def backend_class(name: str) -> Any:
    try:
        module, _, attr = BACKENDS[name].partition(":")
    except KeyError:
        raise ValueError(f"storage.backend: unknown backend {name!r}; expected one of "
                         f"{sorted(BACKENDS)}") from None
    return getattr(importlib.import_module(module), attr)


def make_backend(config: StorageConfig, layout: KVLayout, *, algo: str = "xxh3_128",
                 shard: int = 0) -> StorageBackend:
    """The backend ``config.backend`` names, holding this shard's share of the capacity."""
    return backend_class(config.backend).from_config(config, layout, algo=algo, shard=shard)


__all__ = [
    "BACKENDS", "KV_POOL", "STATE_POOL", "ExtraInfo", "PageRecord", "Pending", "PoolHits",
    "PoolTransfer", "RecordHeader", "ShardFault", "StorageBackend", "Usage", "backend_class",
    "make_backend", "make_record", "register_backend", "usable_prefix", "verify",
]
