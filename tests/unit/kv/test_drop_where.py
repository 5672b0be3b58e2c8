"""``RadixCache.drop_where``: what a tenant's purge drops from a worker's L1 and L2."""

from __future__ import annotations

import torch

from pd_cache.core.config import KVLayout
from pd_cache.core.hashing import namespace_seed
from pd_cache.core.vocab import Tier
from pd_cache.kv import CacheKey, PagePool, RadixCache

PS = 2
LAYOUT = KVLayout(model_id="t", kv_dtype="float32", num_layers=1, page_size=PS,
                  num_kv_heads=1, head_dim=2)


def insert(cache: RadixCache, tokens: list[int], salt: str) -> CacheKey:
    k = CacheKey.build(tokens, page_size=PS, cache_salt=salt)
    cache.insert(k, torch.zeros(k.num_pages, *LAYOUT.page_shape),
                 seed=namespace_seed(None, salt))
    return k


def test_a_purged_namespace_leaves_both_tiers_and_a_locked_path_stays() -> None:
    cache = RadixCache(PagePool("device", 8, LAYOUT), PagePool("host", 8, LAYOUT))
    gone = insert(cache, [1, 2, 3, 4, 5, 6], "acme")
    held = insert(cache, [7, 7, 8, 8], "acme")
    kept = insert(cache, [1, 2, 3, 4], "beta")
    cache.evict(Tier.DEVICE, 2)   # some of them on the host only
    locked = cache.match_prefix(held)
    cache.lock(locked.node)
    doomed = namespace_seed(None, "acme")
    assert cache.drop_where(lambda node: node.seed == doomed) == 3
    assert cache.match_prefix(gone).num_pages == 0
    assert cache.match_prefix(held).num_pages == 2 and cache.match_prefix(kept).num_pages == 2
    cache.check_invariants()
    cache.unlock(locked.node)
    assert cache.drop_where(lambda node: node.seed == doomed) == 2
    assert cache.match_prefix(kept).num_pages == 2
    cache.check_invariants()
    cache.clear()
    assert cache.device.used == 0 and cache.host.used == 0
