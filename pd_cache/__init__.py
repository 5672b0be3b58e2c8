"""pd-cache: a KV-cache layer for prefill/decode disaggregated LLM serving on Ray."""

from pd_cache.config import CacheConfig, KVLayout, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.hashing import compute_prefix_hash, from_hex, namespace_seed, page_hashes, to_hex
from pd_cache.request import Req, SamplingParams

__all__ = [
    "CacheConfig", "KVLayout", "ModelConfig", "PDCacheConfig", "StorageConfig",
    "compute_prefix_hash", "from_hex", "namespace_seed", "page_hashes", "to_hex",
    "Req", "SamplingParams",
]
__version__ = "0.1.0"
