"""The two exporters behind ``PDCacheMetrics``: ``ray.util.metrics`` inside a Ray worker
(exported with a ``ray_`` prefix on each node's metrics port), ``prometheus_client`` in a
plain process (its own ``CollectorRegistry``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pd_cache.metrics.spec import EXPORTERS, MetricSpec

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
