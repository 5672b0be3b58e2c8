"""peer.json from the measured runs: medians per point and server, the headline ratios
pd-cache / peer, a markdown table and a plot."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import overhead
from points import SLO_TPOT_MS, SLO_TTFT_MS, length_mismatch, median_of

KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p90_ms", "goodput_rps", "throughput_rps",
        "output_tok_s", "hit_rate", "completed", "failed")
HEADLINE = "compute/multi-turn"


def build(measured: dict[str, Any], args: argparse.Namespace,
          machine: dict[str, Any]) -> dict[str, Any]:
    points: dict[str, Any] = {}
    for key, cell in measured["cells"].items():
        row: dict[str, Any] = {}
        for server, runs in cell.items():
            row[server] = {k: median_of(runs, k) for k in KEYS}
            row[server]["output_tokens_total"] = median_of(
                [{"n": sum((r.get("output_tokens") or {}).values())} for r in runs], "n")
            row[server]["errors"] = [r["error"] for r in runs if r.get("error")]
        if "peer" in cell:
            row["output_length_mismatches"] = length_mismatch(cell["pd"], cell["peer"])
        points[key] = row
    result: dict[str, Any] = {
        "schema": "pdcache.peer/1", "machine": machine,
        "peer": args.peer_url or args.peer, "repeats": args.repeats,
        "slo": {"ttft_p90_ms": SLO_TTFT_MS, "tpot_p90_ms": SLO_TPOT_MS},
        "startup_s": measured["startup_s"], "skipped": measured["skipped"],
        "points": points, "goodput": goodput(points)}
    if "hops" in measured:
        result["overhead"] = overhead.breakdown(measured["hops"], measured["floor"]["min_ms"])
        result["overhead"]["floor"] = measured["floor"]
        result["overhead"]["stamps"] = measured["hops"]   # raw, for another breakdown
    result.update(ratios(result))
    return result


def goodput(points: dict[str, Any]) -> dict[str, Any]:
    """Per checkpoint/workload and server: the most requests/s completed within the SLO at
    any rate of the grid."""
    best: dict[str, dict[str, float]] = {}
    for key, row in points.items():
        group = key.rsplit("/", 1)[0]
        for server in ("pd", "peer"):
            value = (row.get(server) or {}).get("goodput_rps")
            if value is not None:
                slot = best.setdefault(group, {})
                slot[server] = max(slot.get(server, 0.0), value)
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    """The headline keys of the issue: pd-cache / peer."""
    points, best = result["points"], result["goodput"]
    multi = [row for key, row in points.items() if key.startswith(HEADLINE + "/")]
    zero = [row for key, row in points.items() if key.startswith("compute/zero-reuse/")] or \
        [row for key, row in points.items() if "/zero-reuse/" in key]
    lowest = multi[0] if multi else None   # the lowest rate: TTFT without queueing
    out: dict[str, Any] = {
        "ttft_p50_ratio": _ratio(lowest["pd"]["ttft_p50_ms"], lowest.get("peer", {}).get(
            "ttft_p50_ms")) if lowest else None,
        "goodput_ratio": _ratio(best.get(HEADLINE, {}).get("pd"),
                                best.get(HEADLINE, {}).get("peer")),
        "zero_reuse_throughput_ratio": _ratio(
            max((r["pd"]["output_tok_s"] or 0 for r in zero), default=None),
            max((r.get("peer", {}).get("output_tok_s") or 0 for r in zero), default=None)),
        "serving_overhead_ms": (result.get("overhead") or {}).get("serving_overhead_ms")}
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"peer: {result['peer']}; medians of {result['repeats']} runs; load average "
             f"{result['machine']['load_avg_before']} before, "
             f"{result['machine']['load_avg_after']} after ({result['machine']['cpus']} "
             f"CPUs)", "",
             "| point | server | TTFT p50 ms | TTFT p90 ms | TPOT p90 ms | goodput req/s | "
             "out tok/s | hit rate | done/failed | len mismatch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in result["points"].items():
        for server in ("pd", "peer"):
            s = row.get(server)
            if s is None:
                continue
            lines.append(f"| {key} | {server} | {_f(s['ttft_p50_ms'])} | "
                         f"{_f(s['ttft_p90_ms'])} | {_f(s['tpot_p90_ms'])} | "
                         f"{_f(s['goodput_rps'], 2)} | {_f(s['output_tok_s'])} | "
                         f"{_f(s['hit_rate'], 2)} | {_f(s['completed'])}/{_f(s['failed'])} | "
                         f"{row.get('output_length_mismatches', '')} |")
    lines += ["", "| key | value |", "|---|---|"]
    for key in ("ttft_p50_ratio", "goodput_ratio", "zero_reuse_throughput_ratio",
                "serving_overhead_ms"):
        lines.append(f"| `{key}` | {result.get(key)} |")
    if result.get("overhead"):
        o = result["overhead"]
        lines += ["", f"serving overhead (tiny checkpoint, one request at a time, "
                      f"{o['requests']} requests): TTFT p50 {o['ttft_p50_ms']} ms, floor "
                      f"{o['floor_ms']} ms", "", "| hop | p50 ms |", "|---|---|"]
        lines += [f"| {k.removesuffix('_ms')} | {v} |" for k, v in o["hops_p50_ms"].items()]
    if result["skipped"]:
        lines += ["", f"skipped (past the time budget): {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def _f(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}"


def drawn_at(rate: float, rates: list[float]) -> float:
    """Where ``rate`` goes on the plot's rate axis: itself, or for ``inf`` (every request at
    once) twice the largest finite one of ``rates`` (4 req/s when there is none)."""
    if math.isfinite(rate):
        return rate
    return 2 * max((r for r in rates if math.isfinite(r)), default=4.0)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT p50 and goodput against the rate, per checkpoint/workload, both servers."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for key, row in result["points"].items():
        group, rate = key.rsplit("/", 1)
        try:
            x = float(rate)
        except ValueError:
            continue   # the trace's own times, low-load: not on a rate axis
        groups.setdefault(group, []).append((x, row))
    if not groups:
        return
    rates = [x for rows in groups.values() for x, _ in rows]
    fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 6), squeeze=False)
    for col, (group, rows) in enumerate(sorted(groups.items())):
        at_once = any(not math.isfinite(x) for x, _ in rows)
        rows = sorted(((drawn_at(x, rates), row) for x, row in rows), key=lambda r: r[0])
        for server, style in (("pd", "o-"), ("peer", "s--")):
            xs = [r for r, row in rows if server in row]
            if not xs:
                continue
            axes[0][col].plot(xs, [row[server]["ttft_p50_ms"] for _, row in rows
                                   if server in row], style, label=server)
            axes[1][col].plot(xs, [row[server]["goodput_rps"] for _, row in rows
                                   if server in row], style, label=server)
        axes[0][col].set_title(group, fontsize=9)
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("TTFT p50 (ms)")
        axes[1][col].set_ylabel("goodput (req/s)")
        axes[1][col].set_xlabel("request rate (req/s; rightmost: all at once)" if at_once
                                else "request rate (req/s)")
        axes[0][col].legend(fontsize=8)
    fig.suptitle(f"pd-cache vs {result['peer']} (load avg "
                 f"{result['machine']['load_avg_before'][0]})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
