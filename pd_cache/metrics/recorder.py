"""``PDCacheMetrics``: every pd-cache instrument, in one class, behind two exporters.

It records through ``ray.util.metrics`` inside Ray actors (Ray exports each name with a
``ray_`` prefix on every node's metrics port, where the Ray dashboard and Prometheus read
it) or through ``prometheus_client`` in a plain process (its own ``CollectorRegistry``,
served by :func:`pd_cache.metrics.serve_http`). What it records is listed in
``pd_cache.metrics.spec``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pd_cache.core.vocab import Event, MissReason
from pd_cache.metrics.http import MetricsServer, serve_http
from pd_cache.metrics.instruments import _PromInstrument, _RayInstrument, resolve_exporter
from pd_cache.metrics.spec import METRIC_NAMES, METRICS, VOCABULARIES, amount, check_label


class PDCacheMetrics:
    """All pd-cache instruments. Create one per process (actor) and keep it.

    ``exporter``: ``"ray"``, ``"prometheus"`` or ``"auto"``. With ``"prometheus"`` the
    instruments live in ``registry`` (a new ``CollectorRegistry`` if omitted, so several
    instances never clash). Every method raises ``ValueError`` for a label value outside
    its vocabulary or a negative / non-finite amount, before recording anything.
    ``tenants``: the tenant names of the API-key file, the only values of a ``tenant``
    label (none by default: only the ingress of a server with keys records per tenant).
    """

    def __init__(self, exporter: str = "auto", registry: Any = None,
                 tenants: tuple[str, ...] = ()) -> None:
        if not all(isinstance(t, str) and t for t in tenants):
            raise ValueError(f"tenants: expected non-empty names, got {tenants!r}")
        self._vocabularies = {**VOCABULARIES, "tenant": tuple(tenants)}
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
        value = amount(spec, field, value)
        checked = {key: check_label(spec, key, labels[key], self._vocabularies)
                   for key in spec.labels}
        self._instruments[name].record(value, checked)

    # -- requests and tokens ---------------------------------------------------------
    def count_request(self, role: str, namespace_kind: str = "none", n: int = 1) -> None:
        self._record("pd_cache_requests_total", n, role=role, namespace_kind=namespace_kind)

    def count_tokens(self, role: str, token_kind: str, n: int) -> None:
        self._record("pd_cache_tokens_total", n, role=role, token_kind=token_kind)

    def count_prefix_queries(self, n: int) -> None:
        """Prompt tokens looked up in the prefix cache (found ones: ``count_cached_tokens``)."""
        self._record("pd_cache_prefix_cache_queries_tokens_total", n)

    def count_index_queries(self, n: int = 1) -> None:
        self._record("pd_cache_index_queries_total", n)

    def count_cached_tokens(self, tier: str, n: int) -> None:
        self._record("pd_cache_cached_tokens_total", n, tier=tier)

    def observe_ttft(self, seconds: float, role: str = "decode") -> None:
        self._record("pd_cache_ttft_seconds", seconds, "seconds", role=role)

    def observe_inter_token(self, seconds: float, role: str = "decode") -> None:
        self._record("pd_cache_inter_token_seconds", seconds, "seconds", role=role)

    def observe_e2e(self, seconds: float) -> None:
        self._record("pd_cache_e2e_seconds", seconds, "seconds")

    def observe_queue(self, seconds: float, role: str = "decode") -> None:
        self._record("pd_cache_queue_seconds", seconds, "seconds", role=role)

    # -- tenants of the key file (the ingress) -----------------------------------------
    def count_tenant_tokens(self, tenant: str, token_kind: str, n: int) -> None:
        self._record("pd_cache_tenant_tokens_total", n, tenant=tenant, token_kind=token_kind)

    def count_tenant_cached_tokens(self, tenant: str, n: int) -> None:
        self._record("pd_cache_tenant_cached_tokens_total", n, tenant=tenant)

    def count_rate_limited(self, tenant: str, n: int = 1) -> None:
        self._record("pd_cache_tenant_rate_limited_total", n, tenant=tenant)

    def set_tenant_l3_bytes(self, tenant: str, nbytes: int) -> None:
        self._record("pd_cache_tenant_l3_bytes", nbytes, "nbytes", tenant=tenant)
    def set_tenant_pinned_bytes(self, tenant: str, nbytes: int) -> None:
        self._record("pd_cache_tenant_pinned_bytes", nbytes, "nbytes", tenant=tenant)

    # -- L3 ----------------------------------------------------------------------------
    def count_miss(self, reason: MissReason | str, n: int = 1) -> None:
        self._record("pd_cache_storage_misses_total", n, reason=reason)

    def count_repairs(self, n: int) -> None:
        self._record("pd_cache_storage_repairs_total", n)

    def set_under_replicated(self, pages: int) -> None:
        self._record("pd_cache_storage_under_replicated_pages", pages)

    def count_storage_stats(self, snapshot: Mapping[str, int], backend: str = "memory",
                            source: str = "") -> None:
        """Add what a ``Stats.snapshot()`` counted since the previous call for ``source``.

        ``source`` names the Stats object (for example a shard) so that snapshots of
        several are told apart; it is not a label. A count lower than last time means that
        Stats started again (an actor restart), so its whole value is new, as Prometheus
        treats a counter reset. ``miss/<reason>`` also counts in the misses by reason; a
        miss without a reason counts only as an event; ``refused/<reason>`` also counts in
        the refusals by reason. Validates the whole snapshot first.
        """
        spec = METRIC_NAMES["pd_cache_storage_events_total"]
        check_label(spec, "backend", backend)
        parsed = [self._parse_stat(key, n) for key, n in snapshot.items()]
        deltas = self._since_last((backend, source), [(key, n) for key, _, _, n in parsed])
        for (_, event, reason, _), delta in zip(parsed, deltas):
            self._record("pd_cache_storage_events_total", delta, backend=backend, event=event)
            if event == Event.MISS.value and reason:
                self.count_miss(reason, delta)
            elif event == Event.REFUSED.value and reason:
                self._record("pd_cache_storage_refusals_total", delta, backend=backend,
                             reason=reason)

    def count_storage_calls(self, calls: Mapping[str, int], source: str = "") -> None:
        """Add the calls one shard (``source``) answered since the previous call for it:
        ``calls`` maps an op (exists, get, set) to the shard's running count; a lower
        count is a restarted shard (a counter reset). Validates every entry first."""
        spec = METRIC_NAMES["pd_cache_storage_calls_total"]
        for op, n in calls.items():
            check_label(spec, "op", op)
            amount(spec, op, n)
        deltas = self._since_last(("calls", source), list(calls.items()))
        for op, delta in zip(calls, deltas):
            if delta:
                self._record("pd_cache_storage_calls_total", delta, op=op)

    def _since_last(self, source: tuple[str, str],
                    counts: list[tuple[str, int]]) -> list[int]:
        """Per ``(key, running count)`` of ``source``, what it added since last time (all
        of it after a reset: a count lower than last time)."""
        with self._lock:
            last = self._last_stats.setdefault(source, {})
            deltas = [n - last.get(key, 0) if n >= last.get(key, 0) else n
                      for key, n in counts]
            last.update(counts)
        return deltas

    @staticmethod
    def _parse_stat(key: str, n: Any) -> tuple[str, str, str, int]:
        spec = METRIC_NAMES["pd_cache_storage_events_total"]
        event, _, reason = key.partition("/")
        check_label(spec, "event", event)
        if event in (Event.MISS.value, Event.REFUSED.value) and reason:
            check_label(METRIC_NAMES["pd_cache_storage_misses_total"], "reason", reason)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"snapshot[{key!r}]: expected an int >= 0, got {n!r}")
        return key, event, reason, n

    # -- transfers ---------------------------------------------------------------------
    def observe_prefetch(self, pages: int, nbytes: int, seconds: float,
                         backend: str = "memory", outcome: str = "ok") -> None:
        """One request's prefetch: the pages (bytes) that landed, and how it ended."""
        self._transfer("prefetch", pages, nbytes, seconds, backend=backend, outcome=outcome)

    def observe_backup(self, pages: int, nbytes: int, seconds: float,
                       backend: str = "memory", outcome: str = "ok") -> None:
        """One request's write to L3: the pages (bytes) L3 acknowledged, and how it ended."""
        self._transfer("backup", pages, nbytes, seconds, backend=backend, outcome=outcome)

    def observe_backup_wait(self, seconds: float, backend: str = "memory") -> None:
        """How long one request's write to L3 waited for the write thread to begin it."""
        self._record("pd_cache_backup_wait_seconds", seconds, "seconds", backend=backend)

    def observe_handoff(self, pages: int, nbytes: int, seconds: float) -> None:
        self._transfer("handoff", pages, nbytes, seconds)

    def count_kept(self, pages: int, nbytes: int, by_tier: Mapping[str, int]) -> None:
        """A handoff's pages decode supplied itself, and the tiers they came from."""
        self._record("pd_cache_handoff_kept_pages_total", pages, "pages")
        self._record("pd_cache_handoff_kept_bytes_total", nbytes, "nbytes")
        for tier, n in by_tier.items():
            if n:
                self._record("pd_cache_decode_cache_hits_pages_total", n, "pages", tier=tier)

    def _transfer(self, what: str, pages: int, nbytes: int, seconds: float,
                  **labels: str) -> None:
        # Check all three before recording any, so a bad call leaves no partial trace.
        for name, value, field in ((f"pd_cache_{what}_pages_total", pages, "pages"),
                                   (f"pd_cache_{what}_bytes_total", nbytes, "nbytes"),
                                   (f"pd_cache_{what}_seconds", seconds, "seconds")):
            spec = METRIC_NAMES[name]
            amount(spec, field, value)
            for key in spec.labels:
                check_label(spec, key, labels[key])
        self._record(f"pd_cache_{what}_pages_total", pages, "pages", **labels)
        self._record(f"pd_cache_{what}_bytes_total", nbytes, "nbytes", **labels)
        self._record(f"pd_cache_{what}_seconds", seconds, "seconds", **labels)

    def count_offload(self, page_kind: str, pages: int) -> None:
        self._record("pd_cache_offload_pages_total", pages, "pages", page_kind=page_kind)

    # -- pools ---------------------------------------------------------------------------
    def set_pool(self, tier: str, used: int, capacity: int) -> None:
        spec = METRIC_NAMES["pd_cache_pool_used_pages"]
        if amount(spec, "used", used) > amount(spec, "capacity", capacity):
            raise ValueError(f"{spec.name}: used={used} exceeds capacity={capacity}")
        self._record("pd_cache_pool_used_pages", used, "used", tier=tier)
        self._record("pd_cache_pool_capacity_pages", capacity, "capacity", tier=tier)

    def set_storage_usage(self, used: int, capacity: int, backend: str = "memory") -> None:
        """One L3 shard's bytes held and capacity (each shard reports its own)."""
        spec = METRIC_NAMES["pd_cache_storage_used_bytes"]
        if amount(spec, "used", used) > amount(spec, "capacity", capacity):
            raise ValueError(f"{spec.name}: used={used} exceeds capacity={capacity}")
        self._record("pd_cache_storage_used_bytes", used, "used", backend=backend)
        self._record("pd_cache_storage_capacity_bytes", capacity, "capacity", backend=backend)

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
