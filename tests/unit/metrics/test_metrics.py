"""pd_cache.metrics through the prometheus_client exporter, scraped over real HTTP."""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason, namespace_kind
from pd_cache.metrics import (
    METRIC_NAMES,
    METRICS,
    RAY_PREFIX,
    VOCABULARIES,
    PDCacheMetrics,
    exported_series,
    markdown_table,
    resolve_exporter,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode("utf-8")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def served() -> Iterator[tuple[PDCacheMetrics, str]]:
    metrics = PDCacheMetrics("prometheus", tenants=("acme",))
    server = metrics.serve()
    assert server.host == "127.0.0.1" and server.port > 0
    yield metrics, server.url
    server.stop()


def bucket_counts(observations: list[float], buckets: tuple[float, ...]) -> dict[str, float]:
    """Cumulative bucket counts as Prometheus exposes them, computed independently."""
    out = {f"{b}": float(sum(o <= b for o in observations)) for b in buckets}
    out["+Inf"] = float(len(observations))
    return out


def test_every_instrument_is_served_over_http(served):
    metrics, url = served
    metrics.count_request("prefill", namespace_kind("tenant-a", None))
    metrics.count_request("prefill", "both", n=2)
    metrics.count_request("decode")
    metrics.count_tokens("prefill", "prompt", 96)
    metrics.count_tokens("prefill", "computed", 32)
    metrics.count_tokens("decode", "generated", 20)
    metrics.count_cached_tokens("device", 16)
    metrics.count_cached_tokens("storage", 48)
    metrics.count_cached_tokens("storage", 16)
    metrics.count_miss(MissReason.VERIFICATION_FAILED)
    metrics.count_miss("timeout", 3)
    metrics.count_storage_stats({"hit/": 9, "miss/not_stored": 2, "refused/storage_error": 1},
                                backend="memory")
    metrics.count_storage_calls({"exists": 0, "get": 2, "set": 1}, source="shard0")
    metrics.observe_prefetch(4, 4096, 0.003, backend="disk")
    metrics.observe_prefetch(2, 2048, 0.2, backend="disk", outcome="short")
    metrics.observe_backup(5, 5120, 0.04)
    metrics.observe_backup_wait(0.3)
    metrics.observe_handoff(6, 6144, 0.0007)
    metrics.count_kept(3, 3072, {"device": 2, "host": 1, "storage": 0})
    metrics.count_offload("prompt", 2)
    metrics.count_offload("generated", 1)
    metrics.set_pool("device", 10, 256)
    metrics.set_pool("device", 12, 256)  # a gauge keeps the last value
    metrics.set_storage_usage(3 << 20, 1 << 30, "disk")
    metrics.set_pool("storage", 0, 4096)
    ttft = [0.003, 0.2, 0.2, 7.0]
    for s in ttft:
        metrics.observe_ttft(s, "decode")
    metrics.observe_inter_token(0.02, "decode")
    metrics.observe_e2e(0.5)
    metrics.observe_queue(0.002, "decode")
    metrics.count_prefix_queries(96)
    metrics.count_tenant_tokens("acme", "prompt", 30)
    metrics.count_tenant_cached_tokens("acme", 16)
    metrics.count_rate_limited("acme")
    metrics.set_tenant_l3_bytes("acme", 5 << 20)
    metrics.set_tenant_pinned_bytes("acme", 4096)

    got = scrape(url)
    names = {name for name, _ in got}
    for spec in METRICS:  # every instrument is exported, under its documented name
        assert set(spec.series()) <= names, spec.name

    assert value(got, "pd_cache_backup_wait_seconds_sum", backend="memory") == 0.3
    assert value(got, "pd_cache_handoff_kept_pages_total") == 3
    assert value(got, "pd_cache_handoff_kept_bytes_total") == 3072
    assert value(got, "pd_cache_decode_cache_hits_pages_total", tier="host") == 1
    assert ("pd_cache_decode_cache_hits_pages_total",
            frozenset({("tier", "storage")})) not in got
    assert value(got, "pd_cache_requests_total", role="prefill",
                 namespace_kind="extra_key") == 1
    assert value(got, "pd_cache_requests_total", role="prefill", namespace_kind="both") == 2
    assert value(got, "pd_cache_requests_total", role="decode", namespace_kind="none") == 1
    assert value(got, "pd_cache_tokens_total", role="prefill", token_kind="computed") == 32
    assert value(got, "pd_cache_tokens_total", role="decode", token_kind="generated") == 20
    assert value(got, "pd_cache_cached_tokens_total", tier="storage") == 64
    assert value(got, "pd_cache_cached_tokens_total", tier="device") == 16
    assert ("pd_cache_cached_tokens_total", frozenset({("tier", "host")})) not in got
    assert value(got, "pd_cache_storage_misses_total", reason="verification_failed") == 1
    assert value(got, "pd_cache_storage_misses_total", reason="timeout") == 3
    assert value(got, "pd_cache_storage_misses_total", reason="not_stored") == 2
    assert value(got, "pd_cache_storage_events_total", backend="memory", event="hit") == 9
    assert value(got, "pd_cache_storage_refusals_total", backend="memory",
                 reason="storage_error") == 1
    assert value(got, "pd_cache_storage_calls_total", op="get") == 2
    assert ("pd_cache_storage_calls_total", frozenset({("op", "exists")})) not in got
    assert value(got, "pd_cache_prefetch_pages_total", backend="disk", outcome="ok") == 4
    assert value(got, "pd_cache_prefetch_bytes_total", backend="disk", outcome="short") == 2048
    assert value(got, "pd_cache_prefetch_seconds_count", backend="disk", outcome="ok") == 1
    assert value(got, "pd_cache_backup_bytes_total", backend="memory", outcome="ok") == 5120
    assert value(got, "pd_cache_prefix_cache_queries_tokens_total") == 96
    assert value(got, "pd_cache_e2e_seconds_count") == 1
    assert value(got, "pd_cache_queue_seconds_bucket", role="decode", le="0.005") == 1
    assert value(got, "pd_cache_handoff_pages_total") == 6
    assert value(got, "pd_cache_handoff_seconds_bucket", le="0.001") == 1
    assert value(got, "pd_cache_handoff_seconds_bucket", le="0.0005") == 0
    assert value(got, "pd_cache_offload_pages_total", page_kind="prompt") == 2
    assert value(got, "pd_cache_pool_used_pages", tier="device") == 12
    assert value(got, "pd_cache_pool_capacity_pages", tier="storage") == 4096
    spec = METRIC_NAMES["pd_cache_ttft_seconds"]
    for le, count in bucket_counts(ttft, spec.buckets).items():
        assert value(got, "pd_cache_ttft_seconds_bucket", role="decode", le=le) == count, le
    assert math.isclose(value(got, "pd_cache_ttft_seconds_sum", role="decode"), sum(ttft))
    assert value(got, "pd_cache_inter_token_seconds_count", role="decode") == 1
    assert value(got, "pd_cache_tenant_tokens_total", tenant="acme", token_kind="prompt") == 30
    assert value(got, "pd_cache_tenant_cached_tokens_total", tenant="acme") == 16
    assert value(got, "pd_cache_tenant_rate_limited_total", tenant="acme") == 1
    assert value(got, "pd_cache_tenant_l3_bytes", tenant="acme") == 5 << 20


@pytest.mark.parametrize("call, named", [
    (lambda m: m.count_request("router"), "router"),
    (lambda m: m.count_rate_limited("tenant-b"), "tenant-b"),   # not in the key file
    (lambda m: m.count_request("prefill", namespace_kind="tenant-a"), "tenant-a"),
    (lambda m: m.count_tokens("prefill", "rid-7f3a", 4), "rid-7f3a"),
    (lambda m: m.count_cached_tokens("gpu", 16), "gpu"),
    (lambda m: m.count_miss("lora-adapter-17"), "lora-adapter-17"),
    (lambda m: m.observe_prefetch(1, 10, 0.1, backend="s3"), "s3"),
    (lambda m: m.count_offload("decode", 1), "decode"),
    (lambda m: m.observe_backup(1, 10, 0.1, outcome="tenant-a"), "tenant-a"),
    (lambda m: m.observe_queue(-0.1), "-0.1"),
    (lambda m: m.set_pool("l4", 1, 2), "l4"),
    (lambda m: m.observe_ttft(0.1, role="user-42"), "user-42"),
    (lambda m: m.count_cached_tokens("host", -1), "-1"),
    (lambda m: m.count_cached_tokens("host", True), "True"),
    (lambda m: m.observe_ttft(float("nan")), "nan"),
    (lambda m: m.observe_handoff(1, 10, float("inf")), "inf"),
    (lambda m: m.observe_backup(1, -10, 0.1), "-10"),
    (lambda m: m.set_pool("host", 9, 8), "capacity=8"),
])
def test_bad_label_or_amount_is_refused_and_records_nothing(served, call, named):
    metrics, url = served
    with pytest.raises(ValueError, match=re.escape(named)):
        call(metrics)
    # Nothing was recorded, not even the parts of a multi-instrument call before the bad one.
    assert not [k for k, v in scrape(url).items()
                if v and not k[0].endswith("_created")]


def test_vocabularies_are_fixed_and_names_follow_the_convention():
    assert VOCABULARIES["reason"] == tuple(r.value for r in MissReason)
    assert set(VOCABULARIES["reason"]) == {"not_stored", "evicted", "verification_failed",
                                           "namespace_refused", "timeout", "storage_error",
                                           "cross_namespace", "disk_full", "key_retired",
                                           "stale_index", "quota"}
    assert VOCABULARIES["op"] == ("exists", "get", "set")
    suffix = {"counter": ("_total",), "histogram": ("_seconds",),
              "gauge": ("_pages", "_bytes")}
    for spec in METRICS:
        assert spec.name.startswith("pd_cache_") and spec.name.endswith(suffix[spec.kind])
        assert set(spec.labels) <= set(VOCABULARIES), spec.name
        assert list(spec.buckets) == sorted(spec.buckets)
        assert bool(spec.buckets) == (spec.kind == "histogram")
    assert len(METRIC_NAMES) == len(METRICS)
    assert f"{RAY_PREFIX}pd_cache_ttft_seconds_bucket" in exported_series(RAY_PREFIX)
    table = markdown_table()
    assert all(f"`{spec.name}`" in table for spec in METRICS)


def test_namespace_kind_never_carries_the_value():
    assert namespace_kind(None, None) == "none"
    assert namespace_kind("adapter-x", None) == "extra_key"
    assert namespace_kind(None, "salt-secret") == "cache_salt"
    assert namespace_kind("adapter-x", "salt-secret") == "both"


def test_storage_stats_adds_deltas_since_the_last_snapshot(served):
    metrics, url = served
    shard0, shard1 = Stats(), Stats()
    shard0.count(Event.HIT, n=5)
    shard0.count(Event.MISS, MissReason.EVICTED, n=2)
    shard0.count(Event.MISS, n=1)  # a miss without a reason: an event, not a reason
    metrics.count_storage_stats(shard0.snapshot(), backend="disk", source="shard0")
    metrics.count_storage_stats(shard0.snapshot(), backend="disk", source="shard0")  # no change
    shard0.count(Event.HIT, n=3)
    shard0.count(Event.MISS, MissReason.VERIFICATION_FAILED)
    metrics.count_storage_stats(shard0.snapshot(), backend="disk", source="shard0")
    shard1.count(Event.HIT, n=4)
    metrics.count_storage_stats(shard1.snapshot(), backend="disk", source="shard1")

    got = scrape(url)
    total_hits = shard0.get(Event.HIT) + shard1.get(Event.HIT)
    assert value(got, "pd_cache_storage_events_total", backend="disk", event="hit") == total_hits
    misses = shard0.get(Event.MISS, MissReason.EVICTED) + shard0.get(Event.MISS) + 1
    assert value(got, "pd_cache_storage_events_total", backend="disk", event="miss") == misses
    assert value(got, "pd_cache_storage_misses_total", reason="evicted") == 2
    assert value(got, "pd_cache_storage_misses_total", reason="verification_failed") == 1

    # A full disk: its refusals are refused events, a later lookup a disk_full miss.
    shard1.count(Event.REFUSED, MissReason.DISK_FULL, n=3)
    shard1.count(Event.MISS, MissReason.DISK_FULL, n=2)
    metrics.count_storage_stats(shard1.snapshot(), backend="disk", source="shard1")
    got = scrape(url)
    assert value(got, "pd_cache_storage_events_total", backend="disk", event="refused") == 3
    assert value(got, "pd_cache_storage_refusals_total", backend="disk",
                 reason="disk_full") == 3
    assert value(got, "pd_cache_storage_misses_total", reason="disk_full") == 2

    # A restarted shard starts its Stats from zero: its new counts are all new.
    restarted = Stats()
    restarted.count(Event.HIT, n=2)
    metrics.count_storage_stats(restarted.snapshot(), backend="disk", source="shard0")
    got = scrape(url)
    assert value(got, "pd_cache_storage_events_total", backend="disk",
                 event="hit") == total_hits + 2


@pytest.mark.parametrize("snapshot, backend, named", [
    ({"hit/": 1, "exploded/": 1}, "memory", "exploded"),
    ({"hit/": 1, "miss/rid-1234": 1}, "memory", "rid-1234"),
    ({"hit/": -1}, "memory", "-1"),
    ({"hit/": 1}, "redis", "redis"),
])
def test_bad_storage_snapshot_is_refused_whole(served, snapshot, backend, named):
    metrics, url = served
    with pytest.raises(ValueError, match=re.escape(named)):
        metrics.count_storage_stats(snapshot, backend=backend)
    assert not [k for k, v in scrape(url).items() if v and not k[0].endswith("_created")]
    # The refused snapshot did not move the baseline: a good one still counts in full.
    metrics.count_storage_stats({"hit/": 1}, backend="memory")
    assert value(scrape(url), "pd_cache_storage_events_total", backend="memory",
                 event="hit") == 1


def test_instances_have_their_own_registries():
    a, b = PDCacheMetrics("prometheus"), PDCacheMetrics("prometheus")
    a.count_cached_tokens("host", 7)
    assert 'pd_cache_cached_tokens_total{tier="host"} 7.0' in a.exposition()
    assert 'tier="host"' not in b.exposition()


def test_server_stops():
    metrics = PDCacheMetrics("prometheus")
    metrics.count_cached_tokens("host", 7)
    with metrics.serve() as server:
        assert value(scrape(server.url), "pd_cache_cached_tokens_total", tier="host") == 7
        metrics.count_cached_tokens("host", 5)   # each scrape reads the live registry
        assert value(scrape(server.url), "pd_cache_cached_tokens_total", tier="host") == 12
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


def test_exporter_choice():
    assert resolve_exporter("auto") == "prometheus"  # no Ray worker in unit tests
    assert resolve_exporter("ray") == "ray"
    with pytest.raises(ValueError, match="exporter"):
        PDCacheMetrics("statsd")
    with pytest.raises(ValueError, match="port"):
        PDCacheMetrics("prometheus").serve(port=70000)
