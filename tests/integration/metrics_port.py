"""Reading the Ray metrics port in a test: pd-cache's samples, and the series the Grafana
dashboard queries that some processes do not export yet."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pd_cache.metrics import METRICS, RAY_PREFIX

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "pd-cache-dashboard.json"


def samples(port: int) -> list[Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8")
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(RAY_PREFIX + "pd_cache_")]


def dashboard_series() -> set[str]:
    """The series the dashboard queries, but the per-tenant ones: only an ingress with an
    API-key file exports those (``tests/integration/test_openai.py`` reads them)."""
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
             for t in panel["targets"]]
    per_tenant = {RAY_PREFIX + name for spec in METRICS if "tenant" in spec.labels
                  for name in spec.series()}
    return {name for expr in exprs for name in re.findall(r"ray_pd_cache_\w+", expr)} \
        - per_tenant


def missing_series(port: int, workers: set[str]) -> set[str]:
    """Dashboard series that none of ``workers`` exports yet (waits up to 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        got = {s.name for s in samples(port) if s.labels.get("WorkerId") in workers}
        missing = dashboard_series() - got
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)
