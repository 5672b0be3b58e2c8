"""What a bench run prints: one run's table and a rate sweep's table, read from summaries
(``summary.summarize`` documents); nothing here computes a statistic anew."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pd_cache.core.vocab import TIERS

SWEEP_COLUMNS = ("req/s", "good/s", "p50 ms", "p99 ms", "hit")


def format_table(summary: dict[str, Any]) -> str:
    """The two-column table printed at the end of a run."""
    res = summary["results"]
    req, tput, lat, cache = res["requests"], res["throughput"], res["latency_ms"], res["cache"]
    rows = [
        ("requests ok / failed / good", f"{req['completed']} / {req['failed']} / {req['good']}"),
        *((f"  errors: {kind}", str(n)) for kind, n in req["errors_by_type"].items()),
        ("duration", f"{res['duration_s']:.2f} s"),
        ("request throughput", f"{tput['request_throughput']:.2f} req/s"),
        (f"goodput ({_slo_text(res['slo'])})", f"{tput['request_goodput']:.2f} req/s"),
        ("tokens/s in / out", f"{tput['input_tok_s']:.1f} / {tput['output_tok_s']:.1f}"),
        ("TTFT p50 / p90 / p99", _ms(lat["ttft"], "median", "p90", "p99")),
        ("TPOT p50 / p99", _ms(lat["tpot"], "median", "p99")),
        ("ITL p99", _ms(lat["itl"], "p99")),
        ("E2EL p50 / p99", _ms(lat["e2el"], "median", "p99")),
        *_cache_rows(cache),
    ]
    width = max(len(k) for k, _ in rows)
    value_width = max(len(v) for _, v in rows)
    return "\n".join(f"{k:<{width}}  {v:>{value_width}}" for k, v in rows)


def format_sweep(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per request rate of a sweep; a group of columns per cache setting.

    Reads each summary's ``config["rate"]`` (a number, or text such as ``"inf"``) and
    ``config.get("cache")``: a label (``True``/``False`` print as on/off) that splits the
    columns into groups; without one every summary is in one group. With exactly two groups
    a last column gives the ratio of their TTFT p50 (second group / first, in the order they
    first appear). Columns: completed req/s, goodput req/s, TTFT p50 and p99 in ms, client
    hit rate. A rate given twice for the same label raises ``ValueError``.
    """
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    rates: list[Any] = []
    labels: list[str] = []
    for i, s in enumerate(summaries):
        config = s.get("config") or {}
        if "rate" not in config:
            raise ValueError(f"format_sweep: summary {i} has no config['rate']")
        rate, label = _rate_text(config["rate"]), _label(config.get("cache"))
        if (rate, label) in cells:
            raise ValueError(f"format_sweep: rate {rate} appears twice for cache={label!r}")
        cells[(rate, label)] = s["flat"]
        if rate not in [_rate_text(r) for r in rates]:
            rates.append(config["rate"])
        if label not in labels:
            labels.append(label)
    header = ["rate"] + [c for _ in labels for c in SWEEP_COLUMNS]
    ratio = len(labels) == 2
    if ratio:
        header.append(f"p50 {labels[1]}/{labels[0]}")
    rows = [header]
    for rate in sorted(rates, key=_rate_key):
        text = _rate_text(rate)
        row = [text] + [c for label in labels for c in _sweep_cells(cells.get((text, label)))]
        if ratio:
            a, b = (cells.get((text, label)) for label in labels)
            row.append(_times(b and b["median_ttft_ms"], a and a["median_ttft_ms"]))
        rows.append(row)
    return _grid(rows, labels)


def _ms(stats: dict[str, float | None], *keys: str) -> str:
    values = [stats[k] for k in keys]
    if all(v is None for v in values):
        return "-"
    return " / ".join("-" if v is None else f"{v:.1f}" for v in values) + " ms"


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def _share(part: float, rest: float) -> float | None:
    return part / (part + rest) if part + rest else None


def _slo_text(slo: dict[str, float | None]) -> str:
    bounds = [f"{k[:-3].upper()}<={v:g}ms" for k, v in slo.items() if v is not None]
    return ", ".join(bounds) if bounds else "no SLO"


def _cache_rows(cache: dict[str, Any]) -> list[tuple[str, str]]:
    client, expected, oracle = cache["client"], cache["expected"], cache["oracle"]
    rows = [("hit rate: client", f"{_pct(client['hit_rate'])} "
                                 f"({client['cached_tokens']}/{client['prompt_tokens']} tok)")]
    if expected["hit_rate"] is not None:
        rows.append(("hit rate: oracle, same requests", _pct(expected["hit_rate"])))
    if oracle:
        rows.append(("hit rate: oracle ideal / LRU", f"{_pct(oracle.get('ideal_hit_rate'))} / "
                                                      f"{_pct(oracle.get('lru_hit_rate'))}"))
    delta = cache["server_delta"]
    if delta:
        prefix = delta.get("prefix_cache", {})
        queried = prefix.get("queried_tokens", 0)
        rows.append(("server: prefix hit rate", f"{_pct(prefix.get('hit_rate'))} "
                                                f"({prefix.get('hit_tokens', 0)}/{queried} tok)"))
        by_tier = delta.get("cached_tokens_by_tier", {})
        rows += [(f"server: cached tokens, {tier}", str(by_tier.get(tier, 0))) for tier in TIERS]
        offload = delta.get("offload_pages", {})
        sent, kept = delta.get("handoff_pages", 0), delta.get("handoff_kept_pages", 0)
        hits = delta.get("decode_cache_hits_by_tier", {})
        rows += [("server: pages handed off P->D", f"{sent} ({_pct(_share(sent, kept))} of "
                                                   f"the prompts' pages)"),
                 ("server: pages kept on decode", f"{kept} ("
                  + ", ".join(f"{t} {hits.get(t, 0)}" for t in TIERS) + ")"),
                 ("server: pages written through", str(delta.get("backup_pages_by_outcome",
                                                                 {}).get("ok", 0))),
                 ("server: pages offloaded by decode", str(sum(offload.values()))),
                 ("server: pages prefetched from L3", str(delta.get("prefetch_pages_by_outcome",
                                                                    {}).get("ok", 0)))]
        misses = {k: v for k, v in delta.get("storage_misses_by_reason", {}).items() if v}
        if misses:
            rows.append(("server: L3 misses by reason",
                         ", ".join(f"{k} {v}" for k, v in sorted(misses.items()))))
    cross = cache["isolation"]["cross_tenant_hit_tokens"]
    rows.append(("cross-tenant hit tokens", "not reported" if cross is None else str(cross)))
    return rows


def _label(cache: Any) -> str:
    if cache is None:
        return ""
    if isinstance(cache, bool):
        return "on" if cache else "off"
    return str(cache)


def _rate_text(rate: Any) -> str:
    return f"{rate:g}" if isinstance(rate, (int, float)) else str(rate)


def _rate_key(rate: Any) -> tuple[int, float]:
    """Numbers in order, then ``inf``, then anything else (in the order given)."""
    try:
        value = float(rate)
    except (TypeError, ValueError):
        return (2, 0.0)
    return (1, 0.0) if math.isinf(value) else (0, value)


def _sweep_cells(flat: dict[str, Any] | None) -> list[str]:
    if flat is None:
        return ["-"] * len(SWEEP_COLUMNS)

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    return [num(flat["request_throughput"], ".2f"), num(flat["request_goodput"], ".2f"),
            num(flat["median_ttft_ms"], ".1f"), num(flat["p99_ttft_ms"], ".1f"),
            _pct(flat["client_hit_rate"])]


def _times(num: float | None, den: float | None) -> str:
    return "-" if num is None or not den else f"{num / den:.2f}x"


def _grid(rows: list[list[str]], labels: list[str]) -> str:
    """Right-aligned columns; above them, ``cache=<label>`` over each group when labelled."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    if labels != [""]:
        n = len(SWEEP_COLUMNS)
        spans = [sum(widths[1 + g * n: 1 + (g + 1) * n]) + 2 * (n - 1)
                 for g in range(len(labels))]
        groups = [f"cache={label}".center(span, "-") for label, span in zip(labels, spans)]
        lines.insert(0, "  ".join([" " * widths[0], *groups]).rstrip())
    return "\n".join(lines)
