"""Reading the Ray metrics port in a test: pd-cache's samples, the series the Grafana
dashboard queries that some processes do not export yet, and a refusal to feed the
refusals panel."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from pd_cache.core.hashing import DIGEST_SIZES, page_hashes
from pd_cache.metrics import METRICS, RAY_PREFIX
from pd_cache.storage import PoolTransfer
from pd_cache.storage.record import make_record

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "pd-cache-dashboard.json"


def samples(port: int) -> list[Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8")
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(RAY_PREFIX + "pd_cache_")]


# NOTE: only a cluster with a page index (``index_shards`` > 0, off by default) counts its
# queries; tests/integration/test_metrics_ray.py sees the series exported from an actor.
WITH_INDEX = {RAY_PREFIX + "pd_cache_index_queries_total"}


def dashboard_series() -> set[str]:
    """The series the dashboard queries, but the per-tenant ones (only an ingress with an
    API-key file exports those: ``tests/integration/test_openai.py`` reads them) and the
    page index's (``WITH_INDEX``)."""
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
             for t in panel["targets"]]
    per_tenant = {RAY_PREFIX + name for spec in METRICS if "tenant" in spec.labels
                  for name in spec.series()}
    return {name for expr in exprs for name in re.findall(r"ray_pd_cache_\w+", expr)} \
        - per_tenant - WITH_INDEX


def missing_series(port: int, workers: set[str]) -> set[str]:
    """Dashboard series that none of ``workers`` exported in any scrape of the last 30 s
    (a gauge is exported for a while after it is set, not for ever)."""
    deadline, got = time.monotonic() + 30, set()
    while True:
        got |= {s.name for s in samples(port) if s.labels.get("WorkerId") in workers}
        missing = dashboard_series() - got
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)


def refuse_a_foreign_record(shard: Any, algo: str = "xxh3_128") -> list[list[bool]]:
    """Offer the L3 ``shard`` (an actor) a well-formed page of another model: it must refuse
    it (``refused/verification_failed``). The acks it returns."""
    import ray

    prior = bytes(DIGEST_SIZES[algo])
    (name,) = page_hashes([7], 1, prior=prior, algo=algo)
    record = make_record(name, prior, [7], {"kv": torch.zeros(2)}, fingerprint="another-model",
                         algo=algo)
    return ray.get(shard.batch_set_v2.remote([PoolTransfer("kv", [name], [record])]))
