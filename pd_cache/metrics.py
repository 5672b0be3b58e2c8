"""Every metric instrument of pd-cache, in one class, behind two exporters.

``PDCacheMetrics`` records through ``ray.util.metrics`` inside Ray actors (Ray exports
each name with a ``ray_`` prefix on every node's metrics port, where the Ray dashboard and
Prometheus read it) or through ``prometheus_client`` in a plain process (its own
``CollectorRegistry``, served by :func:`serve_http`). ``METRICS`` lists every instrument
once: name, kind, labels, help and buckets; tests, the Grafana dashboard and the README
table are checked against it.

Labels come from fixed vocabularies (``VOCABULARIES``) and anything else raises
``ValueError``, so a request id, a token, a raw salt or an adapter name can never become
a label value (each would be a new time series per request).
"""

from __future__ import annotations

import math
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from enum import Enum
from socketserver import ThreadingMixIn
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from pd_cache.stats import Event, MissReason

VOCABULARIES: dict[str, tuple[str, ...]] = {
    "role": ("prefill", "decode"),
    "tier": ("device", "host", "storage"),
    "reason": tuple(r.value for r in MissReason),
    "event": tuple(e.value for e in Event),
    "backend": ("memory", "disk"),
    "namespace_kind": ("none", "extra_key", "cache_salt", "both"),
    "token_kind": ("prompt", "computed", "generated"),
    "page_kind": ("prompt", "generated"),
}

# Seconds. TTFT spans a cached hit (ms) to a long cold prompt (tens of s); transfers of a
# page batch span sub-ms (one node, zero-copy) to seconds (a slow L3).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
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


METRICS: tuple[MetricSpec, ...] = (
    _c("pd_cache_requests_total", ("role", "namespace_kind"), "Requests handled, by role."),
    _c("pd_cache_tokens_total", ("role", "token_kind"),
       "Tokens: prompt (admitted), computed (prefilled by the model), generated (decoded)."),
    _c("pd_cache_cached_tokens_total", ("tier",),
       "Prompt tokens whose KV came from a cache tier instead of being computed."),
    _c("pd_cache_storage_misses_total", ("reason",),
       "L3 pages that could not be used, by reason."),
    _c("pd_cache_storage_events_total", ("backend", "event"),
       "L3 page events (hit, miss, stored, evicted, refused, verification_failed)."),
    _c("pd_cache_prefetch_pages_total", ("backend",), "Pages prefetched L3 -> host."),
    _c("pd_cache_prefetch_bytes_total", ("backend",), "Bytes prefetched L3 -> host."),
    _h("pd_cache_prefetch_seconds", ("backend",), "Duration of one prefetch batch.",
       TRANSFER_BUCKETS),
    _c("pd_cache_backup_pages_total", ("backend",), "Pages written back to L3."),
    _c("pd_cache_backup_bytes_total", ("backend",), "Bytes written back to L3."),
    _h("pd_cache_backup_seconds", ("backend",), "Duration of one write-back batch.",
       TRANSFER_BUCKETS),
    _c("pd_cache_handoff_pages_total", (), "KV pages handed from prefill to decode."),
    _c("pd_cache_handoff_bytes_total", (), "KV bytes handed from prefill to decode."),
    _h("pd_cache_handoff_seconds", (), "Duration of one prefill -> decode KV handoff.",
       TRANSFER_BUCKETS),
    _c("pd_cache_offload_pages_total", ("page_kind",), "Pages the decode side offloaded to L3."),
    _g("pd_cache_pool_used_pages", ("tier",), "Pages in use in a tier's pool."),
    _g("pd_cache_pool_capacity_pages", ("tier",), "Capacity of a tier's pool in pages."),
    _h("pd_cache_ttft_seconds", ("role",), "Time to first token.", TTFT_BUCKETS),
    _h("pd_cache_inter_token_seconds", ("role",), "Time between two output tokens.",
       TOKEN_BUCKETS),
)
METRIC_NAMES: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}
RAY_PREFIX = "ray_"
EXPORTERS = ("auto", "ray", "prometheus")


def exported_series(prefix: str = "") -> frozenset[str]:
    """Every series name PromQL can use, e.g. ``exported_series(RAY_PREFIX)`` for a cluster."""
    return frozenset(name for spec in METRICS for name in spec.series(prefix))


def markdown_table() -> str:
    """The README's metrics table, generated from ``METRICS``."""
    rows = ["| name | kind | labels | meaning |", "|---|---|---|---|"]
    for s in METRICS:
        labels = ", ".join(s.labels) or "-"
        rows.append(f"| `{s.name}` | {s.kind} | {labels} | {s.help} |")
    return "\n".join(rows)


def namespace_kind(extra_key: str | None, cache_salt: str | None) -> str:
    """The ``namespace_kind`` label of a request: which namespace parts it set, never their
    values."""
    if extra_key is not None and cache_salt is not None:
        return "both"
    if extra_key is not None:
        return "extra_key"
    return "cache_salt" if cache_salt is not None else "none"


def check_label(spec: MetricSpec, key: str, value: Any) -> str:
    """The label value as text, or ``ValueError`` if it is outside its vocabulary."""
    text = value.value if isinstance(value, Enum) else value
    if text not in VOCABULARIES[key]:
        raise ValueError(f"{spec.name}: label {key}={value!r} is not one of "
                         f"{list(VOCABULARIES[key])}")
    return text


def _amount(spec: MetricSpec, field: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(f"{spec.name}: {field}: expected a finite number >= 0, got {value!r}")
    return float(value)


_VERBS = {"counter": "inc", "gauge": "set", "histogram": "observe"}


class Instrument(ABC):
    """One exported instrument; ``labels`` are already checked against the vocabulary."""

    @abstractmethod
    def record(self, value: float, labels: dict[str, str]) -> None:
        """Add ``value`` (counter), set it (gauge) or observe it (histogram)."""


class _PromInstrument(Instrument):
    def __init__(self, spec: MetricSpec, registry: Any) -> None:
        import prometheus_client as pc

        kwargs: dict[str, Any] = {"labelnames": spec.labels, "registry": registry}
        if spec.kind == "histogram":
            kwargs["buckets"] = spec.buckets
        klass = {"counter": pc.Counter, "gauge": pc.Gauge, "histogram": pc.Histogram}
        self._metric = klass[spec.kind](spec.name, spec.help, **kwargs)
        self._verb = _VERBS[spec.kind]

    def record(self, value: float, labels: dict[str, str]) -> None:
        child = self._metric.labels(**labels) if labels else self._metric
        getattr(child, self._verb)(value)


class _RayInstrument(Instrument):
    def __init__(self, spec: MetricSpec) -> None:
        from ray.util import metrics as rm

        if spec.kind == "histogram":
            self._metric = rm.Histogram(spec.name, spec.help, list(spec.buckets), spec.labels)
        else:
            klass = rm.Counter if spec.kind == "counter" else rm.Gauge
            self._metric = klass(spec.name, spec.help, spec.labels)
        self._verb = _VERBS[spec.kind]

    def record(self, value: float, labels: dict[str, str]) -> None:
        # NOTE: Ray refuses Counter.inc(0); a zero increment changes nothing anyway.
        if self._verb == "inc" and value == 0:
            return
        getattr(self._metric, self._verb)(value, tags=labels or None)


def resolve_exporter(exporter: str) -> str:
    """``auto`` is ``ray`` inside a Ray worker (actor or task), else ``prometheus``."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter: expected one of {list(EXPORTERS)}, got {exporter!r}")
    if exporter != "auto":
        return exporter
    try:
        import ray
    except ImportError:
        return "prometheus"
    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        return "ray"
    return "prometheus"


class PDCacheMetrics:
    """All pd-cache instruments. Create one per process (actor) and keep it.

    ``exporter``: ``"ray"``, ``"prometheus"`` or ``"auto"``. With ``"prometheus"`` the
    instruments live in ``registry`` (a new ``CollectorRegistry`` if omitted, so several
    instances never clash). Every method raises ``ValueError`` for a label value outside
    its vocabulary or a negative / non-finite amount, before recording anything.
    """

    def __init__(self, exporter: str = "auto", registry: Any = None) -> None:
        self.exporter = resolve_exporter(exporter)
        if self.exporter == "prometheus":
            import prometheus_client as pc

            self.registry = registry if registry is not None else pc.CollectorRegistry()
            self._instruments = {s.name: _PromInstrument(s, self.registry) for s in METRICS}
        else:
            if registry is not None:
                raise ValueError("registry: only the prometheus exporter takes a registry")
            self.registry = None
            self._instruments = {s.name: _RayInstrument(s) for s in METRICS}
        self._last_stats: dict[tuple[str, str], dict[str, int]] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, value: Any, field: str = "n", **labels: Any) -> None:
        spec = METRIC_NAMES[name]
        amount = _amount(spec, field, value)
        checked = {key: check_label(spec, key, labels[key]) for key in spec.labels}
        self._instruments[name].record(amount, checked)

    # -- requests and tokens ---------------------------------------------------------
    def count_request(self, role: str, namespace_kind: str = "none", n: int = 1) -> None:
        self._record("pd_cache_requests_total", n, role=role, namespace_kind=namespace_kind)

    def count_tokens(self, role: str, token_kind: str, n: int) -> None:
        self._record("pd_cache_tokens_total", n, role=role, token_kind=token_kind)

    def count_cached_tokens(self, tier: str, n: int) -> None:
        self._record("pd_cache_cached_tokens_total", n, tier=tier)

    def observe_ttft(self, seconds: float, role: str = "decode") -> None:
        self._record("pd_cache_ttft_seconds", seconds, "seconds", role=role)

    def observe_inter_token(self, seconds: float, role: str = "decode") -> None:
        self._record("pd_cache_inter_token_seconds", seconds, "seconds", role=role)

    # -- L3 ----------------------------------------------------------------------------
    def count_miss(self, reason: MissReason | str, n: int = 1) -> None:
        self._record("pd_cache_storage_misses_total", n, reason=reason)

    def count_storage_stats(self, snapshot: Mapping[str, int], backend: str = "memory",
                            source: str = "") -> None:
        """Add what a ``Stats.snapshot()`` counted since the previous call for ``source``.

        ``source`` names the Stats object (for example a shard) so that snapshots of
        several are told apart; it is not a label. A count lower than last time means that
        Stats started again (an actor restart), so its whole value is new, as Prometheus
        treats a counter reset. ``miss/<reason>`` also counts in the misses by reason; a
        miss without a reason counts only as an event. Validates the whole snapshot first.
        """
        spec = METRIC_NAMES["pd_cache_storage_events_total"]
        check_label(spec, "backend", backend)
        parsed = [self._parse_stat(key, n) for key, n in snapshot.items()]
        with self._lock:
            last = self._last_stats.setdefault((backend, source), {})
            deltas = [(event, reason, n - last.get(key, 0) if n >= last.get(key, 0) else n)
                      for key, event, reason, n in parsed]
            last.update({key: n for key, _, _, n in parsed})
        for event, reason, delta in deltas:
            self._record("pd_cache_storage_events_total", delta, backend=backend, event=event)
            if event == Event.MISS.value and reason:
                self.count_miss(reason, delta)

    @staticmethod
    def _parse_stat(key: str, n: Any) -> tuple[str, str, str, int]:
        spec = METRIC_NAMES["pd_cache_storage_events_total"]
        event, _, reason = key.partition("/")
        check_label(spec, "event", event)
        if event == Event.MISS.value and reason:
            check_label(METRIC_NAMES["pd_cache_storage_misses_total"], "reason", reason)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"snapshot[{key!r}]: expected an int >= 0, got {n!r}")
        return key, event, reason, n

    # -- transfers ---------------------------------------------------------------------
    def observe_prefetch(self, pages: int, nbytes: int, seconds: float,
                         backend: str = "memory") -> None:
        self._transfer("prefetch", pages, nbytes, seconds, backend=backend)

    def observe_backup(self, pages: int, nbytes: int, seconds: float,
                       backend: str = "memory") -> None:
        self._transfer("backup", pages, nbytes, seconds, backend=backend)

    def observe_handoff(self, pages: int, nbytes: int, seconds: float) -> None:
        self._transfer("handoff", pages, nbytes, seconds)

    def _transfer(self, what: str, pages: int, nbytes: int, seconds: float,
                  **labels: str) -> None:
        # Check all three before recording any, so a bad call leaves no partial trace.
        for name, value, field in ((f"pd_cache_{what}_pages_total", pages, "pages"),
                                   (f"pd_cache_{what}_bytes_total", nbytes, "nbytes"),
                                   (f"pd_cache_{what}_seconds", seconds, "seconds")):
            _amount(METRIC_NAMES[name], field, value)
        self._record(f"pd_cache_{what}_pages_total", pages, "pages", **labels)
        self._record(f"pd_cache_{what}_bytes_total", nbytes, "nbytes", **labels)
        self._record(f"pd_cache_{what}_seconds", seconds, "seconds", **labels)

    def count_offload(self, page_kind: str, pages: int) -> None:
        self._record("pd_cache_offload_pages_total", pages, "pages", page_kind=page_kind)

    # -- pools ---------------------------------------------------------------------------
    def set_pool(self, tier: str, used: int, capacity: int) -> None:
        spec = METRIC_NAMES["pd_cache_pool_used_pages"]
        if _amount(spec, "used", used) > _amount(spec, "capacity", capacity):
            raise ValueError(f"{spec.name}: used={used} exceeds capacity={capacity}")
        self._record("pd_cache_pool_used_pages", used, "used", tier=tier)
        self._record("pd_cache_pool_capacity_pages", capacity, "capacity", tier=tier)

    # -- exposition ------------------------------------------------------------------------
    def exposition(self) -> str:
        """The Prometheus text format of this instance (prometheus exporter only)."""
        self._need_prometheus("exposition")
        import prometheus_client as pc

        return pc.generate_latest(self.registry).decode("utf-8")

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
        """Serve ``/metrics`` over HTTP; ``port=0`` picks a free one. Stop it when done."""
        self._need_prometheus("serve")
        return serve_http(self.registry, host, port)

    def _need_prometheus(self, what: str) -> None:
        if self.exporter != "prometheus":
            raise ValueError(f"{what}: needs exporter='prometheus'; with exporter='ray' Ray "
                             "serves the metrics on each node's metrics port")


class MetricsServer:
    """A running ``prometheus_client`` HTTP server; ``stop()`` (or ``with``) ends it."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_http(registry: Any, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread."""
    import prometheus_client as pc

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
    server_class = _IPv6Server if ":" in host else _Server
    httpd = make_server(host, port, pc.make_wsgi_app(registry), server_class, _QuietHandler)
    # NOTE: a short poll interval so that stop() returns in ~50 ms, not serve_forever's 0.5 s.
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              name="pd-cache-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per scrape on stderr is noise
