"""A shard counts the calls it answers, by op, and its exporter adds them to
``pd_cache_storage_calls_total{op}`` (a restarted shard reads as a counter reset)."""

from __future__ import annotations

from pd_cache.core.config import PDCacheConfig
from pd_cache.metrics import PDCacheMetrics
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.storage.exporter import StatsExporter
from pd_cache.storage.record import KV_POOL
from pd_cache.storage.tier import StorageTier
from tests.unit.storage.records import Chain


def kv(keys: list[bytes], pages: list | None = None) -> list[PoolTransfer]:
    return [PoolTransfer(KV_POOL, keys, pages)]


def calls_total(metrics: PDCacheMetrics, op: str) -> float:
    return metrics.registry.get_sample_value("pd_cache_storage_calls_total", {"op": op}) or 0.0


def exporter(tier: StorageTier, metrics: PDCacheMetrics) -> StatsExporter:
    return StatsExporter(tier.backend.stats, "memory", "shard0", 5.0, metrics=metrics,
                         calls=tier.calls)


def test_a_shard_counts_each_call_it_answers_and_exports_the_deltas() -> None:
    cfg = PDCacheConfig()
    chain = Chain(cfg.layout, 3)
    info = ExtraInfo(prefix_keys=[], namespace_seed=chain.seed)
    tier, metrics = StorageTier(cfg, export_stats=False), PDCacheMetrics("prometheus")
    assert tier.calls() == {"exists": 0, "get": 0, "set": 0}

    assert tier.backend.batch_set(chain.names, chain.records, info) == [True] * 3
    assert tier.calls()["set"] == 0   # the backend itself is not the shard's caller
    tier.batch_set_v2(kv(chain.names, chain.records), info)
    assert tier.batch_exists_v2(kv(chain.names), info).usable == 3
    tier.batch_get_v2(kv(chain.names), info)
    tier.batch_get_shared_v2(kv(chain.names[:1]), info)
    assert tier.calls() == {"exists": 1, "get": 2, "set": 1}

    exporter(tier, metrics).export()
    tier.batch_get_v2(kv(chain.names), info)
    exporter(tier, metrics).export()
    assert [calls_total(metrics, op) for op in ("exists", "get", "set")] == [1, 3, 1]

    restarted = StorageTier(cfg, export_stats=False)   # counts from zero again: 1 < 3
    restarted.batch_get_v2(kv(chain.names), info)
    exporter(restarted, metrics).export()
    assert calls_total(metrics, "get") == 4
