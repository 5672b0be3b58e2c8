"""Metrics: the list of instruments (``spec``), their two exporters (``instruments``),
the recorder every component uses (``PDCacheMetrics``) and a standalone HTTP endpoint."""

from pd_cache.metrics.http import MetricsServer, serve_http
from pd_cache.metrics.instruments import resolve_exporter
from pd_cache.metrics.recorder import PDCacheMetrics
from pd_cache.metrics.spec import (
    METRIC_NAMES,
    METRICS,
    RAY_PREFIX,
    VOCABULARIES,
    MetricSpec,
    exported_series,
    markdown_table,
)

__all__ = [
    "METRICS", "METRIC_NAMES", "RAY_PREFIX", "VOCABULARIES", "MetricSpec", "MetricsServer",
    "PDCacheMetrics", "exported_series", "markdown_table", "resolve_exporter", "serve_http",
]
