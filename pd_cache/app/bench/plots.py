"""Figures of a bench run and of a rate sweep, as small PNGs beside ``summary.json``.

matplotlib is imported inside the functions (the ``plots`` extra, which ``make run``
installs; not a base dependency), and used through ``Figure`` with the Agg canvas, never
``pyplot``: no global backend to switch, no figure kept alive after it is saved. Without
matplotlib each function raises ``RuntimeError`` saying what to install; the caller reports
it and skips the plots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd_cache.app.bench.records import RequestRecord

_SIZE = (6.4, 4.0)
_DPI = 100


def plot_run(records: Sequence[RequestRecord], summary: dict[str, Any],
             out_dir: str | Path) -> list[Path]:
    """``ttft_cdf.png`` (TTFT CDF of the completed requests) and ``turns.png`` (hit rate
    and TTFT p50 by turn; the oracle's expected hit rate dashed). Both are always written;
    a panel without data says so."""
    figure = _figure_class()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [_ttft_cdf(figure, records, summary, out / "ttft_cdf.png"),
            _turns(figure, summary, out / "turns.png")]


def plot_sweep(summaries: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """``sweep.png``: TTFT p50 (solid) and p99 (dashed), and goodput, against the request
    rate; one colour per ``config["cache"]`` label. Rates that are not finite numbers
    (``inf``: everything sent at once) have no place on the axis and are left out."""
    figure = _figure_class()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for i, s in enumerate(summaries):
        config = s.get("config") or {}
        if "rate" not in config:
            raise ValueError(f"plot_sweep: summary {i} has no config['rate']")
        rate = _finite(config["rate"])
        if rate is not None:
            lines.setdefault(_label(config.get("cache")), []).append((rate, s["flat"]))
    fig = figure(figsize=(_SIZE[0] * 1.6, _SIZE[1]), dpi=_DPI)
    ttft, good = fig.subplots(1, 2)
    for n, (label, points) in enumerate(lines.items()):
        points.sort(key=lambda p: p[0])
        rates = [p[0] for p in points]
        color, name = f"C{n}", label or "run"
        ttft.plot(rates, [_nan(p[1]["median_ttft_ms"]) for p in points], "o-", color=color,
                  label=f"{name} p50")
        ttft.plot(rates, [_nan(p[1]["p99_ttft_ms"]) for p in points], "o--", color=color,
                  label=f"{name} p99")
        good.plot(rates, [_nan(p[1]["request_goodput"]) for p in points], "o-", color=color,
                  label=name)
    _axes(ttft, "TTFT against request rate", "request rate (req/s)", "TTFT (ms)", bool(lines))
    _axes(good, "Goodput against request rate", "request rate (req/s)",
          "goodput under SLO (req/s)", bool(lines))
    good.set_ylim(bottom=0)
    return [_save(fig, out / "sweep.png")]


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("plots need matplotlib, which make run installs: pip install -e "
                           "'.[plots]' (or pip install 'pd-cache[plots]'); the numbers are "
                           "written without it") from e
    return Figure


def _ttft_cdf(figure: Any, records: Sequence[RequestRecord], summary: dict[str, Any],
              path: Path) -> Path:
    ttft = sorted(r.ttft_ms for r in records if r.ok and r.ttft_ms is not None)
    fig = figure(figsize=_SIZE, dpi=_DPI)
    ax = fig.subplots()
    if ttft:
        n = len(ttft)
        ax.step(ttft, [(i + 1) / n for i in range(n)], where="post", color="C0")
        stats = summary["results"]["latency_ms"]["ttft"]
        for key, style in (("median", ":"), ("p99", "--")):
            ax.axvline(stats[key], color="grey", linestyle=style,
                       label=f"{'p50' if key == 'median' else key} {stats[key]:.1f} ms")
        ax.set_ylim(0, 1.02)
    _axes(ax, f"TTFT CDF ({len(ttft)} completed requests)", "TTFT (ms)",
          "fraction of requests", bool(ttft))
    return _save(fig, path)


def _turns(figure: Any, summary: dict[str, Any], path: Path) -> Path:
    rows = summary["results"]["per_turn"]
    turns = [row["turn"] for row in rows]
    fig = figure(figsize=(_SIZE[0] * 1.6, _SIZE[1]), dpi=_DPI)
    hit, ttft = fig.subplots(1, 2)
    hit.plot(turns, [_nan(row["hit_rate"]) for row in rows], "o-", color="C0",
             label="client (server's cached_tokens)")
    hit.plot(turns, [_nan(row["expected_hit_rate"]) for row in rows], "o--", color="C1",
             label="oracle expected")
    hit.set_ylim(-0.02, 1.02)
    ttft.plot(turns, [_nan(row["ttft_ms_p50"]) for row in rows], "o-", color="C2",
              label="TTFT p50")
    for ax in (hit, ttft):
        ax.set_xticks(turns)
    has_hit = any(row["hit_rate"] is not None or row["expected_hit_rate"] is not None
                  for row in rows)
    _axes(hit, "Prefix hit rate by turn", "turn", "cached / prompt tokens", has_hit)
    _axes(ttft, "TTFT p50 by turn", "turn", "TTFT (ms)",
          any(row["ttft_ms_p50"] is not None for row in rows))
    return _save(fig, path)


def _axes(ax: Any, title: str, xlabel: str, ylabel: str, has_data: bool) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not has_data:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _nan(value: float | None) -> float:
    """``None`` as NaN: matplotlib leaves a gap there."""
    return math.nan if value is None else float(value)


def _finite(rate: Any) -> float | None:
    try:
        value = float(rate)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _label(cache: Any) -> str:
    if isinstance(cache, bool):
        return "cache on" if cache else "cache off"
    return "" if cache is None else f"cache {cache}"
