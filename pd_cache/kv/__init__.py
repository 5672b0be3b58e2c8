"""Worker-local KV tiers: page pools (L1 device, L2 host) and the radix prefix cache."""

from pd_cache.kv.allocator import SlotAllocator
from pd_cache.kv.base import (
                              CacheInvariantError,
                              CacheKey,
                              HitPage,
                              InsertResult,
                              MatchResult,
                              PoolFullError,
                              PrefixCache,
                              SlotError,
)
from pd_cache.kv.pages import check_pages, kv_to_pages, kv_torch_dtype, pages_to_kv
from pd_cache.kv.pool import PagePool, SlotPool, device_pool, host_pool
from pd_cache.kv.radix import OWNER, Node, RadixCache
from pd_cache.kv.state import StatePool, check_states, checkpoints

__all__ = [
    "CacheInvariantError", "CacheKey", "HitPage", "InsertResult", "MatchResult", "Node",
    "OWNER", "PagePool", "PoolFullError", "PrefixCache", "RadixCache", "SlotAllocator",
    "SlotError", "SlotPool", "StatePool", "check_pages", "check_states", "checkpoints",
    "device_pool", "host_pool", "kv_to_pages", "kv_torch_dtype", "pages_to_kv",
]
