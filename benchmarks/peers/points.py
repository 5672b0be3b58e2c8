"""What the peer benchmark measures: workloads, the rate grid, and one run of ``pd-cache
bench`` against one server, read back from its ``summary.json`` and ``requests.jsonl``."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
SLO_TTFT_MS, SLO_TPOT_MS = 2500.0, 250.0
# NOTE: the last rate is ``inf``: every request at once (multi-turn: every user at once, each
# sending its next turn when its own answer is in). A server's goodput is the most it keeps
# within the SLO at any rate, so the grid must reach what each server can take; ending at a
# rate both servers keep up with would cap both goodputs at that rate.
RATES = (0.25, 0.5, 1.0, 2.0, 4.0, math.inf)
TEXT_VOCAB = 95   # ids the text mode writes as distinct printable characters

# NOTE: every workload's prompts are text of printable characters, one token each at every
# server (see checkpoints.py); output lengths are fixed (32, or the trace's own, cut at 32).
WORKLOADS: dict[str, list[str]] = {
    "multi-turn": ["--workload", "multi-turn", "--tenants", "2", "--users", "4",
                   "--rounds", "3", "--system-len", "2048", "--user-tokens", "64",
                   "--output-len", "32", "--turn-order", "random"],
    "shared-prefix": ["--workload", "shared-prefix", "--tenants", "2", "--groups", "4",
                      "--prompts-per-group", "6", "--system-len", "2048",
                      "--question-len", "64", "--output-len", "32"],
    "zero-reuse": ["--workload", "random", "--input-len", "1024", "--output-len", "32"],
    "trace": ["--workload", "trace", "--trace", "benchmarks/traces/mooncake_small.jsonl",
              "--trace-block-tokens", "16", "--max-output-tokens", "32"],
    # one request at a time: the serving overhead (TTFT minus the in-process compute)
    "low-load": ["--workload", "random", "--input-len", "256", "--output-len", "8",
                 "--max-concurrency", "1"],
}


class Point(NamedTuple):
    """One cell of the grid: a checkpoint, a workload, a rate (``inf`` for low-load and the
    trace's own times), and how many requests each run sends."""

    checkpoint: str
    workload: str
    rate: float
    requests: int

    @property
    def key(self) -> str:
        rate = "own" if self.workload == "trace" else \
            "serial" if self.workload == "low-load" else f"{self.rate:g}"
        return f"{self.checkpoint}/{self.workload}/{rate}"


def bench_command(point: Point, url: str, out: Path, seed: int) -> list[str]:
    rate = "inf" if math.isinf(point.rate) else f"{point.rate:g}"
    return [sys.executable, "-m", "pd_cache.app.bench", "--target", url, "--text-prompts",
            "--no-drop-caches", "--no-plots", "--no-progress", "--vocab-size",
            str(TEXT_VOCAB), "--seed", str(seed), "--warmup-requests", "2",
            "--num-requests", str(point.requests), "--request-rate", rate,
            "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS),
            "--output-dir", str(out), *WORKLOADS[point.workload]]


def run_point(point: Point, url: str, out: Path, seed: int, timeout_s: float) -> dict[str, Any]:
    """One ``pd-cache bench`` run; its figures (``error`` set if it did not finish)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.log", "wb") as log:
        try:
            done = subprocess.run(bench_command(point, url, out, seed), cwd=REPO, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout_s)
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    summary = out / "summary.json"
    if not summary.exists():
        return {"error": f"pd-cache bench exited {code}; see {out / 'bench.log'}"}
    return figures(json.loads(summary.read_text()), out / "requests.jsonl")


def figures(summary: dict[str, Any], requests: Path) -> dict[str, Any]:
    res = summary["results"]
    lat, thr = res["latency_ms"], res["throughput"]
    records = [json.loads(line) for line in requests.read_text().splitlines() if line]
    done = [r for r in records if r.get("error") is None]
    return {"completed": res["requests"]["completed"], "failed": res["requests"]["failed"],
            "ttft_p50_ms": (lat.get("ttft") or {}).get("median"),
            "ttft_p90_ms": (lat.get("ttft") or {}).get("p90"),
            "tpot_p90_ms": (lat.get("tpot") or {}).get("p90"),
            "goodput_rps": thr.get("request_goodput"),
            "throughput_rps": thr.get("request_throughput"),
            "output_tok_s": thr.get("output_tok_s"),
            "hit_rate": res["cache"]["client"].get("hit_rate"),
            "output_tokens": {str(r["index"]): r["output_tokens"] for r in done}}


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def length_mismatch(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """Requests (same repeat, same index) whose answers differ in length between servers."""
    bad = 0
    for ra, rb in zip(a, b):
        la, lb = ra.get("output_tokens") or {}, rb.get("output_tokens") or {}
        bad += sum(1 for k in la.keys() & lb.keys() if la[k] != lb[k])
    return bad
