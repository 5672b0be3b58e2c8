"""The list of every pd-cache metric instrument and the vocabularies of its labels.

``METRICS`` lists every instrument once: name, kind, labels, help and buckets; tests, the
Grafana dashboard and the table in ``docs/metrics.md`` are checked against it. Label values
come from fixed vocabularies (``VOCABULARIES``, built from ``pd_cache.core.vocab``) and
anything else raises ``ValueError``, so a request id, a token, a raw salt or an adapter name
can never become a label value (each would be a new time series per request). The one
vocabulary not fixed here is ``tenant``: empty by default, it holds the tenant names of the
server's API-key file, given to the recorder that the ingress creates (``tenants=``), so
its size is the key file's; a client's ``cache_salt`` or ``user`` never becomes a tenant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import Enum
from typing import Any, NamedTuple

from pd_cache.core.config import STORAGE_BACKENDS
from pd_cache.core.vocab import (
    NAMESPACE_KINDS,
    PAGE_KINDS,
    ROLES,
    STORAGE_OPS,
    TIERS,
    TOKEN_KINDS,
    Event,
    MissReason,
    Outcome,
)

OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)

VOCABULARIES: dict[str, tuple[str, ...]] = {
    "role": ROLES,
    "tier": TIERS,
    "reason": tuple(r.value for r in MissReason),
    "event": tuple(e.value for e in Event),
    "backend": tuple(STORAGE_BACKENDS),
    "namespace_kind": NAMESPACE_KINDS,
    "token_kind": TOKEN_KINDS,
    "page_kind": PAGE_KINDS,
    "outcome": OUTCOMES,
    "op": STORAGE_OPS,
    "tenant": (),   # the key file's tenant names, per recorder (PDCacheMetrics(tenants=...))
}

# Seconds, fit for a small model on CPU and a large one on GPU alike. TTFT and E2E span a
# cached hit of a tiny model (sub-ms) to a long cold prompt (a minute); a decode step spans
# 0.1 ms (tiny, CPU) to seconds (a large batch); transfers of a page batch span sub-ms (one
# node, zero-copy) to seconds (a slow L3); queueing spans nothing to tens of seconds.
TTFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)


class MetricSpec(NamedTuple):
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()

    def series(self, prefix: str = "") -> tuple[str, ...]:
        """Names of the time series this instrument exposes, as PromQL sees them."""
        base = prefix + self.name
        if self.kind == "histogram":
            return (base + "_bucket", base + "_count", base + "_sum")
        return (base,)


def _c(name: str, labels: tuple[str, ...], text: str) -> MetricSpec:
    return MetricSpec(name, "counter", labels, text)


def _g(name: str, labels: tuple[str, ...], text: str) -> MetricSpec:
    return MetricSpec(name, "gauge", labels, text)


def _h(name: str, labels: tuple[str, ...], text: str, buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(name, "histogram", labels, text, buckets)


_XFER = ("backend", "outcome")

METRICS: tuple[MetricSpec, ...] = (
    _c("pd_cache_requests_total", ("role", "namespace_kind"), "Requests handled, by role."),
    _c("pd_cache_tokens_total", ("role", "token_kind"),
       "Tokens: prompt (admitted), computed (prefilled by the model), generated (decoded)."),
    _c("pd_cache_prefix_cache_queries_tokens_total", (),
       "Prompt tokens looked up in the prefix cache (every full page before the last "
       "token; vLLM's prefix_cache_queries)."),
    _c("pd_cache_cached_tokens_total", ("tier",),
       "Prompt tokens found in a cache tier instead of computed (vLLM's "
       "prefix_cache_hits, by tier)."),
    _c("pd_cache_index_queries_total", (),
       "Queries the cluster page index answered (one per index shard a routing asks; a "
       "front routing from its in-sync mirror of the index, index_mirror_s, asks none: "
       "the mirror's long polls are not counted)."),
    _c("pd_cache_storage_misses_total", ("reason",),
       "L3 pages that could not be used, by reason."),
    _c("pd_cache_storage_events_total", ("backend", "event"),
       "L3 page events (hit, miss, stored, evicted, refused, verification_failed)."),
    _c("pd_cache_storage_calls_total", ("op",),
       "L3 calls the shards answered, by operation (exists, get, set): one per shard a "
       "batch reaches."),
    _c("pd_cache_storage_refusals_total", ("backend", "reason"),
       "L3 pages a shard refused to store or serve, by reason (disk_full: the disk's "
       "free-space reserve)."),
    _c("pd_cache_storage_repairs_total", (),
       "L3 pages written back to a replica that lacked them, from another replica's copy "
       "(storage_replicas > 1: a read's repair or rebuild_storage)."),
    _c("pd_cache_prefetch_pages_total", _XFER, "Pages prefetched L3 -> host."),
    _c("pd_cache_prefetch_bytes_total", _XFER, "Bytes prefetched L3 -> host."),
    _h("pd_cache_prefetch_seconds", _XFER,
       "Duration of one request's prefetch (lookup and every batch).", TRANSFER_BUCKETS),
    _c("pd_cache_backup_pages_total", _XFER,
       "Pages written to L3 (prefill write-through and decode offload)."),
    _c("pd_cache_backup_bytes_total", _XFER, "Bytes written to L3."),
    _h("pd_cache_backup_seconds", _XFER, "Duration of one request's write to L3 (every "
       "batch).", TRANSFER_BUCKETS),
    _h("pd_cache_backup_wait_seconds", ("backend",), "Time one request's write to L3 waited "
       "for its worker's write thread (issued to begun: the thread's backlog).",
       TRANSFER_BUCKETS),
    _c("pd_cache_handoff_pages_total", (), "KV pages handed from prefill to decode."),
    _c("pd_cache_handoff_bytes_total", (), "KV bytes handed from prefill to decode."),
    _h("pd_cache_handoff_seconds", (), "Duration of one prefill -> decode KV handoff.",
       TRANSFER_BUCKETS),
    _c("pd_cache_handoff_kept_pages_total", (),
       "KV pages of a prompt that decode supplied itself instead of receiving them."),
    _c("pd_cache_handoff_kept_bytes_total", (), "KV bytes decode supplied itself (not sent)."),
    _c("pd_cache_decode_cache_hits_pages_total", ("tier",),
       "Prompt pages decode's prefix cache supplied, by tier (device, host: reserved; "
       "storage: a lost reservation refilled from L3)."),
    _c("pd_cache_offload_pages_total", ("page_kind",), "Pages the decode side offloaded to L3."),
    _g("pd_cache_pool_used_pages", ("tier",), "Pages in use in a tier's pool."),
    _g("pd_cache_pool_capacity_pages", ("tier",), "Capacity of a tier's pool in pages."),
    _g("pd_cache_storage_used_bytes", ("backend",), "Bytes one L3 shard holds."),
    _g("pd_cache_storage_capacity_bytes", ("backend",), "Capacity of one L3 shard in bytes."),
    _g("pd_cache_storage_under_replicated_pages", (),
       "L3 pages a worker wrote or read that lack one of their storage_replicas copies (a "
       "follower write refused, a replica found without the page, until repaired)."),
    _h("pd_cache_ttft_seconds", ("role",), "Time to first token.", TTFT_BUCKETS),
    _h("pd_cache_inter_token_seconds", ("role",), "Time between two output tokens.",
       TOKEN_BUCKETS),
    _h("pd_cache_e2e_seconds", (), "Request latency the workers time: prefill, KV "
       "handoff and decode.", TTFT_BUCKETS),
    _h("pd_cache_queue_seconds", ("role",), "Time a request waited for a worker's batch.",
       QUEUE_BUCKETS),
    _c("pd_cache_tenant_tokens_total", ("tenant", "token_kind"),
       "Tokens of a key file's tenant, counted by the ingress: prompt (of requests served) "
       "and generated."),
    _c("pd_cache_tenant_cached_tokens_total", ("tenant",),
       "Prompt tokens of a key file's tenant found in a cache tier (its own reuse only)."),
    _c("pd_cache_tenant_rate_limited_total", ("tenant",),
       "Requests of a key file's tenant refused (429) by its key's rate limits."),
    _g("pd_cache_tenant_l3_bytes", ("tenant",),
       "L3 bytes a key file's tenant holds, over every shard (its quota bounds it)."),
    _g("pd_cache_tenant_pinned_bytes", ("tenant",),
       "KV bytes of a key file's tenant's pinned pages (each page once, whatever holds it), "
       "as the ingress last counted them (a pinning request, an admin list or drop)."),
)
METRIC_NAMES: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}
RAY_PREFIX = "ray_"
EXPORTERS = ("auto", "ray", "prometheus")


def exported_series(prefix: str = "") -> frozenset[str]:
    """Every series name PromQL can use, e.g. ``exported_series(RAY_PREFIX)`` for a cluster."""
    return frozenset(name for spec in METRICS for name in spec.series(prefix))


def markdown_table() -> str:
    """The metrics table of ``docs/metrics.md``, generated from ``METRICS``."""
    rows = ["| name | kind | labels | meaning |", "|---|---|---|---|"]
    for s in METRICS:
        labels = ", ".join(s.labels) or "-"
        rows.append(f"| `{s.name}` | {s.kind} | {labels} | {s.help} |")
    return "\n".join(rows)


def check_label(spec: MetricSpec, key: str, value: Any,
                vocabularies: Mapping[str, tuple[str, ...]] = VOCABULARIES) -> str:
    """The label value as text, or ``ValueError`` if it is outside its vocabulary."""
    text = value.value if isinstance(value, Enum) else value
    if text not in vocabularies[key]:
        raise ValueError(f"{spec.name}: label {key}={value!r} is not one of "
                         f"{list(vocabularies[key])}")
    return text


def amount(spec: MetricSpec, field: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{spec.name}: {field}: expected a finite number >= 0, got {value!r}")
    return float(value)
