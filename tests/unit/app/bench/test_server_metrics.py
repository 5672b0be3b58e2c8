"""The server's counters from Prometheus text: Ray's per-process series summed, deltas."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pd_cache.app.bench.server_metrics import (
    PROCESS_LABELS,
    delta,
    parse_counters,
    scrape,
    series_text,
    wait_for_export,
)

W1 = "288a5321654792dc2d84e9bf2cacd61bbf13e6ec78493dd67b988ffb"
W2 = "67c00e81b0f86c7cad1af4ee467a54623fa6b0024d4235f227b5295e"


def ray_labels(worker: str, **ours: str) -> str:
    """The labels Ray 2.60's exporter puts on a user metric, then the metric's own."""
    labels = {"Component": "core_worker", "NodeAddress": "192.0.2.2",
              "SessionName": "session_2026-12-01_05-53-24_348809_14346", "Version": "2.60.0",
              "WorkerId": worker,
              "otel_scope_name": "ray._private.telemetry.open_telemetry_metric_recorder",
              "otel_scope_schema_url": "", "otel_scope_version": ""} | ours
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def ray_text(host_1: float = 30, host_2: float = 50, queried: float = 200) -> str:
    """Two prefill workers and a decode worker on one node, as its metrics port serves them."""
    return f"""\
# HELP ray_pd_cache_cached_tokens_total Prompt tokens found in a cache tier.
# TYPE ray_pd_cache_cached_tokens_total counter
ray_pd_cache_cached_tokens_total{{{ray_labels(W1, tier="host")}}} {host_1}
ray_pd_cache_cached_tokens_total{{{ray_labels(W2, tier="host")}}} {host_2}
ray_pd_cache_cached_tokens_total{{{ray_labels(W2, tier="storage")}}} 16.0
# HELP ray_pd_cache_prefix_cache_queries_tokens_total Prompt tokens looked up.
# TYPE ray_pd_cache_prefix_cache_queries_tokens_total counter
ray_pd_cache_prefix_cache_queries_tokens_total{{{ray_labels(W1)}}} {queried / 2}
ray_pd_cache_prefix_cache_queries_tokens_total{{{ray_labels(W2)}}} {queried / 2}
# HELP ray_pd_cache_storage_misses_total L3 pages that could not be used, by reason.
# TYPE ray_pd_cache_storage_misses_total counter
ray_pd_cache_storage_misses_total{{{ray_labels(W2, reason="not_stored")}}} 4.0
# HELP ray_pd_cache_ttft_seconds Time to first token.
# TYPE ray_pd_cache_ttft_seconds histogram
ray_pd_cache_ttft_seconds_bucket{{{ray_labels(W1, le="0.1", role="decode")}}} 1.0
ray_pd_cache_ttft_seconds_bucket{{{ray_labels(W1, le="+Inf", role="decode")}}} 2.0
ray_pd_cache_ttft_seconds_count{{{ray_labels(W1, role="decode")}}} 2.0
ray_pd_cache_ttft_seconds_sum{{{ray_labels(W1, role="decode")}}} 0.55
# HELP ray_pd_cache_pool_used_pages Pages in use in a tier's pool.
# TYPE ray_pd_cache_pool_used_pages gauge
ray_pd_cache_pool_used_pages{{{ray_labels(W1, tier="host")}}} 7.0
# HELP ray_tasks Current number of tasks.
# TYPE ray_tasks gauge
ray_tasks{{{ray_labels(W1, State="RUNNING")}}} 3.0
# HELP ray_node_network_sent_total Bytes sent.
# TYPE ray_node_network_sent_total counter
ray_node_network_sent_total{{{ray_labels(W1)}}} 1234.0
"""


HOST = ("pd_cache_cached_tokens_total", (("tier", "host"),))
QUERIED = ("pd_cache_prefix_cache_queries_tokens_total", ())


def test_parse_counters_sums_processes_and_keeps_counters_and_histogram_totals():
    got = parse_counters(ray_text())
    assert got == {
        HOST: 80.0,                                   # two worker processes, one series
        ("pd_cache_cached_tokens_total", (("tier", "storage"),)): 16.0,
        QUERIED: 200.0,
        ("pd_cache_storage_misses_total", (("reason", "not_stored"),)): 4.0,
        ("pd_cache_ttft_seconds_count", (("role", "decode"),)): 2.0,
        ("pd_cache_ttft_seconds_sum", (("role", "decode"),)): 0.55,
    }   # no buckets, no gauges, nothing that is not pd-cache's


def test_process_labels_are_ray_labels_not_ours():
    from pd_cache.metrics import METRICS

    ours = {key for spec in METRICS for key in spec.labels}
    assert not ours & PROCESS_LABELS
    assert {"WorkerId", "Component", "NodeAddress", "SessionName", "Version"} <= PROCESS_LABELS


def test_parse_counters_of_a_plain_prometheus_client_page():
    registry = CollectorRegistry()
    Counter("pd_cache_handoff_pages_total", "pages", registry=registry).inc(5)
    Gauge("pd_cache_pool_used_pages", "pages", ["tier"], registry=registry).labels("host").set(3)
    got = parse_counters(generate_latest(registry).decode())
    assert got == {("pd_cache_handoff_pages_total", ()): 5.0}   # no _created sample


def test_parse_counters_refuses_text_that_is_not_prometheus():
    with pytest.raises(ValueError, match="Prometheus"):
        parse_counters("<html>not found</html>\n")


def test_delta_by_tier_reason_and_prefix_cache():
    before = parse_counters(ray_text(host_1=30, host_2=50, queried=200))
    after = parse_counters(ray_text(host_1=40, host_2=90, queried=300))
    after[("pd_cache_handoff_pages_total", ())] = 12.0        # absent before: counts from 0
    after[("pd_cache_handoff_kept_pages_total", ())] = 36.0
    after[("pd_cache_decode_cache_hits_pages_total", (("tier", "device"),))] = 30.0
    after[("pd_cache_decode_cache_hits_pages_total", (("tier", "storage"),))] = 6.0
    d = delta(before, after)
    assert d["handoff_kept_pages"] == 36 and d["handoff_kept_bytes"] == 0
    assert d["decode_cache_hits_by_tier"] == {"device": 30, "host": 0, "storage": 6}
    for key in ("pd_cache_handoff_kept_pages_total", 'pd_cache_decode_cache_hits_pages_total'
                '{tier="device"}', 'pd_cache_decode_cache_hits_pages_total{tier="storage"}'):
        d["raw"].pop(key)
    assert d["cached_tokens_by_tier"] == {"device": 0, "host": 50, "storage": 0}
    assert d["storage_misses_by_reason"]["not_stored"] == 0
    assert set(d["storage_misses_by_reason"]) >= {"not_stored", "evicted", "cross_namespace"}
    assert d["prefix_cache"] == {"queried_tokens": 100, "hit_tokens": 50, "hit_rate": 0.5}
    assert d["handoff_pages"] == 12
    assert d["requests_by_role"] == {"prefill": 0, "decode": 0}
    assert d["prefetch_pages_by_outcome"] == {"ok": 0, "short": 0, "failed": 0}
    assert d["offload_pages"] == {"prompt": 0, "generated": 0}
    assert d["raw"] == {'pd_cache_cached_tokens_total{tier="host"}': 50,
                        "pd_cache_handoff_pages_total": 12,
                        "pd_cache_prefix_cache_queries_tokens_total": 100}
    assert d["reset_series"] == []


def test_delta_of_a_reset_series_is_its_value_after():
    before = {HOST: 100.0, QUERIED: 500.0,
              ("pd_cache_requests_total", (("namespace_kind", "none"), ("role", "prefill"))): 4}
    after = {HOST: 30.0, QUERIED: 600.0,
             ("pd_cache_requests_total", (("namespace_kind", "none"), ("role", "prefill"))): 9,
             ("pd_cache_requests_total", (("namespace_kind", "both"), ("role", "prefill"))): 1}
    d = delta(before, after)
    assert d["cached_tokens_by_tier"]["host"] == 30
    assert d["reset_series"] == [series_text(HOST)] == ['pd_cache_cached_tokens_total{tier="host"}']
    assert d["requests_by_role"] == {"prefill": 6, "decode": 0}
    assert d["prefix_cache"]["hit_rate"] == pytest.approx(0.3)
    assert delta({}, {})["prefix_cache"]["hit_rate"] is None


class _Pages:
    """A metrics endpoint that serves the given pages in turn, then the last one forever."""

    def __init__(self, pages: list[str]) -> None:
        self.pages, self.served = pages, 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.pages[min(owner.served, len(owner.pages) - 1)].encode()
                owner.served += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)

    def __enter__(self) -> _Pages:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_scrape_reads_the_page_and_names_the_url_when_it_cannot():
    with _Pages(["pd_cache_x_total 1\n"]) as pages:
        assert scrape(pages.url) == "pd_cache_x_total 1\n"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    with pytest.raises(RuntimeError, match=url):
        scrape(url, timeout_s=1)


def test_wait_for_export_waits_until_two_scrapes_agree():
    texts = [ray_text(host_1=0), ray_text(host_1=10), ray_text(host_1=20), ray_text(host_1=20)]
    with _Pages(texts) as pages:
        got = wait_for_export(pages.url, interval_s=0.01, timeout_s=10)
        assert pages.served == 4 and got[HOST] == 70.0


def test_wait_for_export_with_a_predicate_and_on_timeout():
    texts = [ray_text(host_1=0), ray_text(host_1=10), ray_text(host_1=20)]
    with _Pages(texts) as pages:
        got = wait_for_export(pages.url, predicate=lambda c: c.get(HOST, 0) >= 60,
                              interval_s=0.01, timeout_s=10)
        assert pages.served == 2 and got[HOST] == 60.0
    # a predicate never met: on timeout the counters come back as they are, no error
    with _Pages([ray_text(host_1=20)]) as pages:
        got = wait_for_export(pages.url, predicate=lambda c: False, interval_s=0.05,
                              timeout_s=0.3)
        assert pages.served >= 1 and got[HOST] == 70.0
    with pytest.raises(ValueError, match="interval_s"):
        wait_for_export("http://127.0.0.1:1/metrics", interval_s=0)
