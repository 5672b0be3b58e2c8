"""The numbers of one bench run: ``summary.json`` beside ``requests.jsonl``, and its table.

``summarize`` turns the records of a run into one JSON document::

    {"schema_version": "pdcache.bench/1",
     "config":  {...},              # as the runner gave it (target, workload, rate, seed, ...)
     "results": {...},              # nested: requests, throughput, latency_ms, cache, ...
     "flat":    {...}}              # one level, vLLM's key names (mean_ttft_ms, ...)

``flat`` uses the key names ``vllm bench serve`` writes, so scripts that plot its results
read ours; pd-cache's own numbers (hit rates, cross-tenant tokens) are added beside them.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from pd_cache.app.bench.records import RequestRecord, encode_lines
from pd_cache.app.bench.tables import format_sweep, format_table

__all__ = ["SCHEMA_VERSION", "SLO", "RunFiles", "format_sweep", "format_table",
           "latency_stats", "summarize", "write_run"]

SCHEMA_VERSION = "pdcache.bench/1"
LATENCIES = ("ttft", "tpot", "itl", "e2el")
# vLLM writes mean, median, std and the percentiles it was asked for (p99 by default).
FLAT_STATS = ("mean", "median", "std", "p90", "p95", "p99")


@dataclass(frozen=True)
class SLO:
    """Bounds a request must meet to count as good (``None``: no bound), in milliseconds.

    A request is good when it completed without an error and meets every bound given. A
    TTFT or E2EL bound is missed when the value is unknown; TPOT is unknown for a request of
    one output token, which has no time between tokens to miss the bound with.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name, bound in asdict(self).items():
            if bound is not None and not (isinstance(bound, (int, float)) and bound > 0
                                          and math.isfinite(bound)):
                raise ValueError(f"SLO {name}: expected a finite number > 0 or None, "
                                 f"got {bound!r}")

    def admits(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.tpot_ms is not None and r.tpot_ms is not None and r.tpot_ms > self.tpot_ms:
            return False
        return all(bound is None or (value is not None and value <= bound)
                   for bound, value in ((self.ttft_ms, r.ttft_ms), (self.e2el_ms, r.e2el_ms)))

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)


class RunFiles(NamedTuple):
    requests: Path
    summary: Path


def latency_stats(values_ms: Iterable[float]) -> dict[str, float | None]:
    """Mean, median, std (population), p90, p95, p99 and max; all ``None`` when empty."""
    a = np.asarray(list(values_ms), dtype=float)
    if a.size == 0:
        return dict.fromkeys(("mean", "median", "std", "p90", "p95", "p99", "max"))
    if not np.isfinite(a).all():
        raise ValueError("latency_stats: every value must be a finite number of ms")
    p90, p95, p99 = np.percentile(a, [90, 95, 99])
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            "p90": float(p90), "p95": float(p95), "p99": float(p99), "max": float(a.max())}


def summarize(records: Iterable[RequestRecord], *, duration_s: float, slo: SLO | None = None,
              server_delta: dict[str, Any] | None = None,
              oracle: dict[str, Any] | None = None,
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``summary.json`` document of a run that lasted ``duration_s`` seconds.

    ``server_delta`` (``server_metrics.delta``) and ``oracle`` (the oracle's hit rates) are
    passed through as given. Rates are per ``duration_s``; token totals and latencies count
    completed requests only.
    """
    if not (isinstance(duration_s, (int, float)) and duration_s > 0
            and math.isfinite(duration_s)):
        raise ValueError(f"duration_s: expected a finite number > 0, got {duration_s!r}")
    records = list(records)
    slo = slo if slo is not None else SLO()
    done = [r for r in records if r.ok]
    good = sum(slo.admits(r) for r in records)
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    results = {
        "duration_s": float(duration_s),
        "requests": {"total": len(records), "completed": len(done),
                     "failed": len(records) - len(done), "good": good,
                     "errors_by_type": _errors_by_type(records)},
        "throughput": {"request_throughput": len(done) / duration_s,
                       "request_goodput": good / duration_s,
                       "input_tok_s": prompt / duration_s, "output_tok_s": output / duration_s,
                       "total_tok_s": (prompt + output) / duration_s},
        "tokens": {"input": prompt, "output": output},
        "latency_ms": {name: latency_stats(v) for name, v in _latencies(done).items()},
        "cache": {"client": _client_cache(done), "expected": _expected_cache(done),
                  "server_delta": server_delta, "oracle": oracle,
                  "isolation": {"cross_tenant_hit_tokens": _cross_tenant(records)}},
        "per_turn": _per_turn(records),
        "time_series": _time_series(records, duration_s),
        "slo": slo.as_dict(),
    }
    return {"schema_version": SCHEMA_VERSION, "config": dict(config or {}),
            "results": results, "flat": _flat(results, config or {})}


def write_run(out_dir: str | Path, records: Iterable[RequestRecord],
              summary: dict[str, Any]) -> RunFiles:
    """``out_dir/requests.jsonl`` (one record a line) and ``out_dir/summary.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = RunFiles(out / "requests.jsonl", out / "summary.json")
    files.requests.write_bytes(encode_lines(records))
    files.summary.write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2)
                              + b"\n")
    return files


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _errors_by_type(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.error_type or "unknown" for r in records if not r.ok)
    return dict(sorted(counts.items()))


def _latencies(done: Sequence[RequestRecord]) -> dict[str, list[float]]:
    return {"ttft": [r.ttft_ms for r in done if r.ttft_ms is not None],
            "tpot": [t for t in (r.tpot_ms for r in done) if t is not None],
            "itl": [gap for r in done for gap in r.itl_ms],
            "e2el": [r.e2el_ms for r in done if r.e2el_ms is not None]}


def _client_cache(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """What the answers' ``cached_tokens`` say, over the completed requests that say it."""
    told = [r for r in done if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in told)
    cached = sum(r.cached_tokens or 0 for r in told)
    tiers: Counter[str] = Counter()
    for r in done:
        tiers.update(r.tier_hits or {})
    return {"requests": len(told), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": _ratio(cached, prompt),
            "tier_hits": dict(tiers) if any(r.tier_hits is not None for r in done) else None}


def _expected_cache(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """The oracle's ideal for the same completed requests, request by request."""
    known = [r for r in done if r.expected_cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in known)
    expected = sum(r.expected_cached_tokens or 0 for r in known)
    return {"requests": len(known), "prompt_tokens": prompt,
            "expected_cached_tokens": expected, "hit_rate": _ratio(expected, prompt)}


def _cross_tenant(records: Sequence[RequestRecord]) -> int | None:
    told = [r.cross_namespace_tokens for r in records if r.cross_namespace_tokens is not None]
    return sum(told) if told else None


def _per_turn(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    by_turn: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_turn[r.turn].append(r)
    rows = []
    for turn in sorted(by_turn):
        done = [r for r in by_turn[turn] if r.ok]
        ttft = latency_stats(r.ttft_ms for r in done if r.ttft_ms is not None)
        rows.append({"turn": turn, "requests": len(by_turn[turn]), "completed": len(done),
                     "ttft_ms_mean": ttft["mean"], "ttft_ms_p50": ttft["median"],
                     "hit_rate": _client_cache(done)["hit_rate"],
                     "expected_hit_rate": _expected_cache(done)["hit_rate"]})
    return rows


def _time_series(records: Sequence[RequestRecord], duration_s: float) -> list[dict[str, Any]]:
    """One-second buckets from the run's start.

    A completion counts in the second its last token arrived (``end_s``); an error in the
    second it ended (``sent_s`` when it has no end); ``sent`` counts requests by ``sent_s``.
    """
    def second(t: float) -> int:
        return max(0, int(math.floor(t)))

    ends = [r.end_s if r.end_s is not None else r.sent_s for r in records]
    n = max([math.ceil(duration_s)] + [second(t) + 1 for t in ends + [r.sent_s for r in records]])
    rows = [{"t_s": float(i), "sent": 0, "completed": 0, "output_tokens": 0, "errors": 0}
            for i in range(n)]
    ttfts: list[list[float]] = [[] for _ in range(n)]
    for r, end in zip(records, ends):
        rows[second(r.sent_s)]["sent"] += 1
        row = rows[second(end)]
        if not r.ok:
            row["errors"] += 1
            continue
        row["completed"] += 1
        row["output_tokens"] += r.output_tokens
        if r.ttft_ms is not None:
            ttfts[second(end)].append(r.ttft_ms)
    for row, values in zip(rows, ttfts):
        row["ttft_ms_p50"] = float(np.median(values)) if values else None
    return rows


def _flat(results: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """One level of numbers under vLLM's names (``bench serve`` result JSON), then ours."""
    req, tput, cache = results["requests"], results["throughput"], results["cache"]
    flat: dict[str, Any] = {
        "duration": results["duration_s"], "completed": req["completed"],
        "failed": req["failed"], "total_input_tokens": results["tokens"]["input"],
        "total_output_tokens": results["tokens"]["output"],
        "request_throughput": tput["request_throughput"],
        "request_goodput": tput["request_goodput"], "output_throughput": tput["output_tok_s"],
        "total_token_throughput": tput["total_tok_s"],
    }
    if "rate" in config:
        flat["request_rate"] = config["rate"]
    for name in LATENCIES:
        for stat in FLAT_STATS:
            flat[f"{stat}_{name}_ms"] = results["latency_ms"][name][stat]
    oracle = cache["oracle"] or {}
    flat.update(client_hit_rate=cache["client"]["hit_rate"],
                expected_hit_rate=cache["expected"]["hit_rate"],
                oracle_ideal_hit_rate=oracle.get("ideal_hit_rate"),
                oracle_lru_hit_rate=oracle.get("lru_hit_rate"),
                cross_tenant_hit_tokens=cache["isolation"]["cross_tenant_hit_tokens"])
    return flat
