"""The server's own view of a bench run: pd-cache counters scraped before and after.

A Prometheus text endpoint (a Ray node's metrics port, or a ``MetricsServer``) is scraped
once before the run and once after; ``delta`` says what the cluster counted in between:
cached tokens by tier, L3 misses by reason, pages moved. Only counters and histogram
``_sum``/``_count`` are kept (gauges do not subtract).

Series are keyed by pd-cache's own name (Ray's ``ray_`` prefix removed) and the labels
that remain once ``PROCESS_LABELS`` are dropped; series that become equal (the same
counter in several worker processes) are summed.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

from pd_cache.core.vocab import PAGE_KINDS, ROLES, TIERS, MissReason
from pd_cache.metrics.spec import OUTCOMES, RAY_PREFIX

Labels = tuple[tuple[str, str], ...]
Counters = dict[tuple[str, Labels], float]

PREFIX = "pd_cache_"
# Labels Ray's exporter adds to every user metric, per process (seen on Ray 2.60: one
# series per worker process of each instrument), plus Prometheus' own target labels when
# the text comes through a Prometheus server. None of them says anything about the cache.
PROCESS_LABELS = frozenset({
    "Component", "NodeAddress", "SessionName", "Version", "WorkerId", "JobId",
    "otel_scope_name", "otel_scope_schema_url", "otel_scope_version",  # Ray >= 2.5x, OTel
    "instance", "job",
})
_HISTOGRAM_SUFFIXES = ("_sum", "_count")


def parse_counters(text: str) -> Counters:
    """Every pd-cache counter and histogram ``_sum``/``_count`` in a Prometheus text page.

    Keys are ``(name, labels)``: the name as pd-cache's spec spells it
    (``pd_cache_cached_tokens_total``, with or without Ray's ``ray_`` prefix in the text),
    the labels sorted, without ``PROCESS_LABELS``. Values of the same key are summed.
    ``ValueError`` if the text is not Prometheus exposition.
    """
    out: Counters = defaultdict(float)
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise ValueError(f"not Prometheus text exposition: {e}") from e
    for family in families:
        for s in family.samples:
            name = s.name[len(RAY_PREFIX):] if s.name.startswith(RAY_PREFIX) else s.name
            if not name.startswith(PREFIX) or not _is_kept(family.type, name):
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in PROCESS_LABELS))
            out[(name, labels)] += s.value
    return dict(out)


def _is_kept(kind: str, sample: str) -> bool:
    if kind == "histogram":
        return sample.endswith(_HISTOGRAM_SUFFIXES)
    return kind in ("counter", "unknown") and sample.endswith("_total")


def series_text(key: tuple[str, Labels]) -> str:
    """``name{k="v",...}``, as PromQL writes a series."""
    name, labels = key
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return f"{name}{{{inner}}}" if labels else name


def delta(before: Counters, after: Counters) -> dict:
    """What the server counted between two scrapes (the ``server_delta`` document)::

        {"cached_tokens_by_tier":     {"device": n, "host": n, "storage": n},
         "storage_misses_by_reason":  {"not_stored": n, ...every MissReason},
         "prefix_cache":              {"queried_tokens": n, "hit_tokens": n, "hit_rate": x},
         "requests_by_role":          {"prefill": n, "decode": n},
         "tokens_by_role":            {"prefill": {"prompt": n, "computed": n, ...}, ...},
         "prefetch_pages_by_outcome": {"ok": n, "short": n, "failed": n},
         "backup_pages_by_outcome":   {"ok": n, "short": n, "failed": n},
         "offload_pages":             {"prompt": n, "generated": n},
         "handoff_pages":             n,   (sent P->D)
         "handoff_kept_pages":        n,   (decode's own: its prefix cache, a refill)
         "handoff_bytes", "handoff_kept_bytes": n,
         "decode_cache_hits_by_tier": {"device": n, "host": n, "storage": n},
         "raw":                       {'pd_cache_..._total{tier="host"}': n, ...},
         "reset_series":              ['pd_cache_...', ...]}

    ``hit_tokens`` is the sum of ``pd_cache_cached_tokens_total`` over tiers (pd-cache's
    prefix-cache hits counter), ``hit_rate`` its share of the queried tokens (``None`` when
    none were queried). ``raw`` holds every series whose value changed. A series absent
    before counts from 0; one that went down (its process restarted and its counter began
    again) counts its value after, and is listed in ``reset_series``: what it counted before
    the restart is lost, so the delta is a lower bound there.
    """
    diff: Counters = {}
    resets = []
    for key, value in after.items():
        old = before.get(key, 0.0)
        if value < old:
            resets.append(series_text(key))
            diff[key] = value
        else:
            diff[key] = value - old
    queried = _sum(diff, "pd_cache_prefix_cache_queries_tokens_total")
    hits = _sum(diff, "pd_cache_cached_tokens_total")
    return {
        "cached_tokens_by_tier": _by(diff, "pd_cache_cached_tokens_total", "tier", TIERS),
        "storage_misses_by_reason": _by(diff, "pd_cache_storage_misses_total", "reason",
                                        [r.value for r in MissReason]),
        "prefix_cache": {"queried_tokens": queried, "hit_tokens": hits,
                         "hit_rate": hits / queried if queried else None},
        "requests_by_role": _by(diff, "pd_cache_requests_total", "role", ROLES),
        "tokens_by_role": {role: _by(diff, "pd_cache_tokens_total", "token_kind",
                                     ("prompt", "computed", "generated"), role=role)
                           for role in ROLES},
        "prefetch_pages_by_outcome": _by(diff, "pd_cache_prefetch_pages_total", "outcome",
                                         OUTCOMES),
        "backup_pages_by_outcome": _by(diff, "pd_cache_backup_pages_total", "outcome",
                                       OUTCOMES),
        "offload_pages": _by(diff, "pd_cache_offload_pages_total", "page_kind", PAGE_KINDS),
        "handoff_pages": _sum(diff, "pd_cache_handoff_pages_total"),
        "handoff_kept_pages": _sum(diff, "pd_cache_handoff_kept_pages_total"),
        "handoff_bytes": _sum(diff, "pd_cache_handoff_bytes_total"),
        "handoff_kept_bytes": _sum(diff, "pd_cache_handoff_kept_bytes_total"),
        "decode_cache_hits_by_tier": _by(diff, "pd_cache_decode_cache_hits_pages_total",
                                         "tier", TIERS),
        "raw": {series_text(k): _number(v) for k, v in sorted(diff.items()) if v != 0},
        "reset_series": sorted(resets),
    }


def _number(value: float) -> int | float:
    """Counts as ints in the JSON; histogram sums (seconds) stay floats."""
    return int(value) if float(value).is_integer() else value


def _sum(diff: Counters, name: str, **match: str) -> int | float:
    return _number(sum(v for (n, labels), v in diff.items()
                       if n == name and all(item in labels for item in match.items())))


def _by(diff: Counters, name: str, label: str, words: Iterable[str],
        **match: str) -> dict[str, int | float]:
    """``name`` summed by one label, every word of its vocabulary present (0 if unseen)."""
    return {w: _sum(diff, name, **{label: w}, **match) for w in words}


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """The text of a GET of ``url``; ``RuntimeError`` naming the URL if that fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8")
    except (urllib.error.URLError, OSError, UnicodeDecodeError) as e:
        raise RuntimeError(f"could not scrape metrics from {url}: {e}") from e


def wait_for_export(url: str, *, predicate: Callable[[Counters], bool] | None = None,
                    interval_s: float = 11.0, timeout_s: float = 60.0,
                    timeout_per_scrape_s: float = 5.0) -> Counters:
    """Scrape until the counters have settled, or ``timeout_s`` passed; the last counters.

    Settled means ``predicate(counters)`` is true when one is given, else that two scrapes
    ``interval_s`` apart give the same pd-cache counters. Ray's metrics agent exports what a
    worker recorded only every ``metrics_report_interval_ms`` (10 s unless the cluster sets
    it) and each L3 shard pushes its counts every ``metrics_interval_s`` (5 s by default),
    so a scrape just after a run misses its last seconds. ``interval_s`` must be longer
    than the slowest of those periods, or two scrapes within one period look settled. On
    timeout the last counters are returned as they are.
    """
    if interval_s <= 0 or timeout_s < 0:
        raise ValueError(f"wait_for_export: interval_s must be > 0 and timeout_s >= 0, got "
                         f"{interval_s!r} and {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    last = parse_counters(scrape(url, timeout_per_scrape_s))
    while True:
        if predicate is not None and predicate(last):
            return last
        if time.monotonic() + interval_s > deadline:
            return last
        time.sleep(interval_s)
        now = parse_counters(scrape(url, timeout_per_scrape_s))
        if predicate is None and now == last:
            return now
        last = now
