"""pd_cache.metrics through ray.util.metrics: a real actor records, the node's Ray metrics
port serves ``ray_pd_cache_...`` series, scraped over HTTP."""

from __future__ import annotations

import time
import urllib.request

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.metrics import METRIC_NAMES, METRICS, RAY_PREFIX, PDCacheMetrics

OUR_LABELS = {key for spec in METRICS for key in spec.labels} | {"le"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@ray.remote(num_cpus=0)
class MetricsProbe:
    """Stands in for a worker: one PDCacheMetrics per process, chosen by 'auto'."""

    def __init__(self) -> None:
        self.metrics = PDCacheMetrics("auto", tenants=("acme",))

    def exporter(self) -> str:
        return self.metrics.exporter

    def worker_id(self) -> str:
        return ray.get_runtime_context().get_worker_id()

    def second_turn(self) -> None:
        """What a worker records when a second turn finds its prefix in L3."""
        m = self.metrics
        m.count_request("prefill", "cache_salt")
        m.count_tokens("prefill", "prompt", 80)
        m.count_tokens("prefill", "computed", 16)
        m.count_cached_tokens("storage", 48)
        m.count_cached_tokens("host", 16)
        m.observe_prefetch(3, 3 * 4096, 0.004)
        m.observe_backup(1, 4096, 0.002, outcome="short")
        m.count_prefix_queries(80)
        m.count_index_queries(2)   # the page index, asked by two routings
        m.observe_e2e(0.4)
        m.observe_queue(0.001)
        m.observe_handoff(5, 5 * 4096, 0.0008)
        m.count_kept(4, 4 * 4096, {"device": 3, "host": 1})   # decode held 4 pages itself
        m.count_tenant_tokens("acme", "prompt", 80)
        m.count_tenant_cached_tokens("acme", 64)
        m.count_rate_limited("acme")
        m.set_tenant_l3_bytes("acme", 5 * 4096)
        m.set_tenant_pinned_bytes("acme", 3 * 4096)
        m.count_offload("generated", 2)
        m.set_pool("host", 7, 1024)
        m.set_storage_usage(3 * 4096, 1 << 20, "memory")
        m.count_repairs(3)            # a read fell back to a second copy and repaired
        m.set_under_replicated(2)
        m.observe_ttft(0.03, "decode")
        m.observe_ttft(0.3, "decode")
        m.observe_inter_token(0.004, "decode")
        shard = Stats()
        shard.count(Event.HIT, n=3)
        shard.count(Event.MISS, MissReason.VERIFICATION_FAILED)  # a corrupted record
        shard.count(Event.REFUSED, MissReason.DISK_FULL)         # the disk's reserve kept
        m.count_storage_stats(shard.snapshot(), source="shard0")
        shard.count(Event.HIT, n=2)
        m.count_storage_stats(shard.snapshot(), source="shard0")
        m.count_storage_calls({"exists": 0, "get": 2, "set": 1}, source="shard0")
        m.count_storage_calls({"exists": 0, "get": 3, "set": 1}, source="shard0")
        # A second instance in the same process records into the same Ray instruments.
        PDCacheMetrics("ray").count_miss("timeout", 2)

    def bad_label(self) -> None:
        self.metrics.count_cached_tokens("rid-0001", 1)


def scrape(port: int, worker_id: str) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8")
    out: Samples = {}
    prefix = RAY_PREFIX + "pd_cache_"
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # NOTE: other tests share the cluster; only this actor's worker is ours.
            if s.name.startswith(prefix) and s.labels.get("WorkerId") == worker_id:
                labels = frozenset((k, v) for k, v in s.labels.items() if k in OUR_LABELS)
                out[(s.name, labels)] = s.value
    return out


def expected() -> Samples:
    """What second_turn() must produce, in Ray's exported names."""
    r = RAY_PREFIX

    def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
        return (r + name, frozenset(labels.items()))

    want = {
        key("pd_cache_requests_total", role="prefill", namespace_kind="cache_salt"): 1,
        key("pd_cache_tokens_total", role="prefill", token_kind="prompt"): 80,
        key("pd_cache_tokens_total", role="prefill", token_kind="computed"): 16,
        key("pd_cache_cached_tokens_total", tier="storage"): 48,
        key("pd_cache_cached_tokens_total", tier="host"): 16,
        key("pd_cache_storage_misses_total", reason="verification_failed"): 1,
        key("pd_cache_storage_misses_total", reason="timeout"): 2,
        key("pd_cache_storage_events_total", backend="memory", event="hit"): 5,
        key("pd_cache_storage_events_total", backend="memory", event="miss"): 1,
        key("pd_cache_storage_events_total", backend="memory", event="refused"): 1,
        key("pd_cache_storage_refusals_total", backend="memory", reason="disk_full"): 1,
        key("pd_cache_storage_calls_total", op="get"): 3,
        key("pd_cache_storage_calls_total", op="set"): 1,
        key("pd_cache_handoff_kept_pages_total"): 4,
        key("pd_cache_handoff_kept_bytes_total"): 4 * 4096,
        key("pd_cache_decode_cache_hits_pages_total", tier="device"): 3,
        key("pd_cache_decode_cache_hits_pages_total", tier="host"): 1,
        key("pd_cache_tenant_tokens_total", tenant="acme", token_kind="prompt"): 80,
        key("pd_cache_tenant_cached_tokens_total", tenant="acme"): 64,
        key("pd_cache_tenant_rate_limited_total", tenant="acme"): 1,
        key("pd_cache_tenant_l3_bytes", tenant="acme"): 5 * 4096,
        key("pd_cache_tenant_pinned_bytes", tenant="acme"): 3 * 4096,
        key("pd_cache_prefetch_pages_total", backend="memory", outcome="ok"): 3,
        key("pd_cache_prefetch_bytes_total", backend="memory", outcome="ok"): 3 * 4096,
        key("pd_cache_prefetch_seconds_count", backend="memory", outcome="ok"): 1,
        key("pd_cache_backup_bytes_total", backend="memory", outcome="short"): 4096,
        key("pd_cache_prefix_cache_queries_tokens_total"): 80,
        key("pd_cache_index_queries_total"): 2,
        key("pd_cache_e2e_seconds_count"): 1,
        key("pd_cache_queue_seconds_count", role="decode"): 1,
        key("pd_cache_handoff_pages_total"): 5,
        key("pd_cache_handoff_bytes_total"): 5 * 4096,
        key("pd_cache_handoff_seconds_count"): 1,
        key("pd_cache_offload_pages_total", page_kind="generated"): 2,
        key("pd_cache_pool_used_pages", tier="host"): 7,
        key("pd_cache_pool_capacity_pages", tier="host"): 1024,
        key("pd_cache_storage_used_bytes", backend="memory"): 3 * 4096,
        key("pd_cache_storage_capacity_bytes", backend="memory"): 1 << 20,
        key("pd_cache_storage_repairs_total"): 3,
        key("pd_cache_storage_under_replicated_pages"): 2,
        key("pd_cache_ttft_seconds_count", role="decode"): 2,
        key("pd_cache_inter_token_seconds_count", role="decode"): 1,
    }
    # Bucket counts of the two TTFT observations, from the declared buckets.
    for bound in METRIC_NAMES["pd_cache_ttft_seconds"].buckets:
        le = str(float(bound))
        want[key("pd_cache_ttft_seconds_bucket", role="decode", le=le)] = (
            (0.03 <= bound) + (0.3 <= bound))
    return want


def test_actor_metrics_reach_the_ray_metrics_port(ray_cluster):
    probe = MetricsProbe.remote()
    assert ray.get(probe.exporter.remote()) == "ray"
    worker_id = ray.get(probe.worker_id.remote())
    ray.get(probe.second_turn.remote())

    want = expected()
    deadline = time.monotonic() + 30
    while True:
        got = scrape(ray_cluster.metrics_port, worker_id)
        missing = {k: v for k, v in want.items() if got.get(k) != v}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, {k: (v, got.get(k)) for k, v in missing.items()}
    # Every instrument that the workload touched is there under its ray_ name.
    names = {name for name, _ in got}
    assert {RAY_PREFIX + s.name for s in METRICS if s.kind != "histogram"} <= names

    with pytest.raises(ValueError, match="rid-0001"):
        ray.get(probe.bad_label.remote())
    ray.kill(probe)
