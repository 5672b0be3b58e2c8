"""pd-cache: a KV-cache layer for prefill/decode disaggregated LLM serving on Ray.

The public API: import from here; it stays stable. Importing ``pd_cache`` is cheap: names
whose modules load torch or Ray (``LocalEngine``, ``PDCluster``, ``Model``,
``reference_generate``, ``make_backend``) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.config import CacheConfig, KVLayout, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.hashing import from_hex, namespace_seed, page_hashes, to_hex
from pd_cache.core.request import Req, SamplingParams, compute_prefix_hash
from pd_cache.core.wire import Completion

if TYPE_CHECKING:
    from pd_cache.cluster.pd_cluster import PDCluster
    from pd_cache.model.model import Model, reference_generate
    from pd_cache.storage import make_backend
    from pd_cache.worker.engine import LocalEngine

_LAZY = {
    "LocalEngine": "pd_cache.worker.engine",
    "Model": "pd_cache.model.model",
    "reference_generate": "pd_cache.model.model",
    "PDCluster": "pd_cache.cluster.pd_cluster",
    "make_backend": "pd_cache.storage",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pd_cache' has no attribute {name!r}")


__all__ = [
    "CacheConfig", "ClusterConfig", "Completion", "KVLayout", "LocalEngine", "Model",
    "ModelConfig", "PDCacheConfig", "PDCluster", "Req", "SamplingParams", "StorageConfig",
    "compute_prefix_hash", "from_hex", "make_backend", "namespace_seed", "page_hashes",
    "reference_generate", "to_hex",
]
__version__ = "0.1.0"
