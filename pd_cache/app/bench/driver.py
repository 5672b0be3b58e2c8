"""One ``pd-cache bench`` invocation: for each cache setting and request rate, warm up,
empty the caches, measure, read the server's counters, and write what happened.

::

    for cache in (on[, off]):            off: --compare-no-cache, local target only
        target = LocalTarget(PDCluster(cache)) | HTTPTarget(url)
        warm up (--warmup-requests, a workload of another seed), drop every cache tier
        for rate in rates:
            counters before -> open loop -> flush L3 writes -> counters after (export waited)
            oracle over the run's own stream -> summary.json, requests.jsonl, plots, table
            drop every cache tier (the next rate starts cold too)

One run writes into ``output_dir``; several (a sweep, a comparison) each into
``output_dir/<cache>-rate<r>/``, with ``sweep.json`` and ``sweep.png`` beside them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pd_cache.app.bench.arrivals import arrival_times
from pd_cache.app.bench.oracle import OracleRequest, simulate
from pd_cache.app.bench.records import RequestRecord
from pd_cache.app.bench.runner import RunOutput, run_open_loop
from pd_cache.app.bench.server_metrics import delta, wait_for_export
from pd_cache.app.bench.summary import (
    SCHEMA_VERSION,
    SLO,
    format_sweep,
    format_table,
    summarize,
    write_run,
)
from pd_cache.app.bench.workloads import Workload


@dataclasses.dataclass(frozen=True)
class Load:
    """How requests arrive: ``rates`` (req/s; ``inf``: all at once) by ``arrival`` with
    ``burstiness``; at most ``max_concurrency`` in flight; ``duration_s`` cuts the stream
    at that arrival time; a trace workload keeps its own times (``rates`` unused).
    ``lockstep``: rounds (a multi-turn workload's turns) one after the other, the next once
    the last answer of this one is in; a line is printed per round.

    A multi-turn workload at rate ``inf`` is a closed loop: every user at once, each sending
    its next turn when its own answer is in; with ``lockstep``, round by round."""

    rates: tuple[float, ...] = (math.inf,)
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    seed: int = 0
    lockstep: bool = False


@dataclasses.dataclass(frozen=True)
class Report:
    """Where and what to write: ``output_dir`` (``None``: no files; ``per_run_dirs``: each
    run in a folder of its own there, for a sweep or a comparison), plots, the SLO of
    goodput, the page rule and LRU capacity of the oracle, the progress bar, and the run's
    own description."""

    output_dir: Path | None
    per_run_dirs: bool = False
    slo: SLO = SLO()
    page_size: int = 16
    lru_capacity_tokens: int | None = None
    plots: bool = True
    progress: bool = True
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


class Server:
    """What the driver needs of a target besides requests: its counters and its flush."""

    def __init__(self, target: Any, *, metrics_url: str | None = None,
                 flush: Callable[[], Any] | None = None, export_interval_s: float = 11.0,
                 label: Any = True) -> None:
        self.target, self.metrics_url, self.flush = target, metrics_url, flush
        self.export_interval_s, self.label = export_interval_s, label
        self.answers: dict[float, dict[int, list[int]]] = {}   # by rate: each request's ids
        self.summaries: list[dict[str, Any]] = []


def arrivals_of(workload: Workload, load: Load, rate: float) -> list[float]:
    """Each request's arrival (s): the trace's own, else drawn at ``rate``."""
    if workload.requests and workload.requests[0].offset_s is not None:
        return [float(r.offset_s) for r in workload.requests]
    times = arrival_times(len(workload.requests), rate, process=load.arrival,
                          burstiness=load.burstiness, seed=load.seed)
    return [float(t) for t in times]


def cut(workload: Workload, arrivals: list[float], duration_s: float | None) -> int:
    """How many leading requests arrive within ``duration_s`` (all without one)."""
    if duration_s is None:
        return len(arrivals)
    return sum(1 for t in arrivals if t <= duration_s)


async def bench(server: Server, workload: Workload, warmup: Workload | None, load: Load,
                report: Report) -> list[dict[str, Any]]:
    """Every rate of ``load`` against ``server``; the summaries, in order."""
    target = server.target
    if warmup is not None and warmup.requests:
        await run_open_loop(target, warmup.requests, [0.0] * len(warmup.requests),
                            max_concurrency=load.max_concurrency or 8)
    summaries = []
    for rate in load.rates:
        await target.drop_caches()
        arrivals = arrivals_of(workload, load, rate)
        n = cut(workload, arrivals, load.duration_s)
        summaries.append(await _measure(server, workload.requests[:n], arrivals[:n], rate,
                                        load, report))
    await target.drop_caches()
    return summaries


async def _measure(server: Server, requests: list[Any], arrivals: list[float], rate: float,
                   load: Load, report: Report) -> dict[str, Any]:
    label = "on" if server.label is True else "off" if server.label is False else server.label
    many = len(load.rates) > 1 or report.per_run_dirs
    out_dir = report.output_dir
    if out_dir is not None and many:
        out_dir = out_dir / f"cache-{label}-rate{_rate_text(rate)}"
    # NOTE: settled first, so the warm-up's and the previous run's last counts are not
    # exported into this run's delta.
    before = await _settled(server)
    bar = _progress(len(requests), f"cache {label}, rate {_rate_text(rate)}", report.progress)
    rounds = RoundLines(requests) if load.lockstep else None

    def done(record: RequestRecord) -> None:
        bar.update(1)
        if rounds is not None:
            rounds.finished(record)
    try:
        run = await run_open_loop(target=server.target, requests=requests, arrivals=arrivals,
                                  max_concurrency=load.max_concurrency,
                                  lockstep=load.lockstep, on_done=done)
    finally:
        bar.close()
    server.answers[rate] = run.answers
    if server.flush is not None:
        await asyncio.to_thread(server.flush)
    server_delta = None
    if before is not None:
        server_delta = delta(before, await _settled(server))
    oracle = _oracle(requests, run, report)
    config = {**report.config, "rate": _rate_json(rate), "cache": server.label,
              "requests": len(requests)}
    summary = summarize(run.records, duration_s=max(run.duration_s, 1e-9), slo=report.slo,
                        server_delta=server_delta, oracle=oracle, config=config)
    if out_dir is None:
        print(f"\n{format_table(summary)}", flush=True)
        return summary
    write_run(out_dir, run.records, summary)
    if report.plots:
        _plot(run, summary, out_dir)
    print(f"\n{out_dir}:\n{format_table(summary)}", flush=True)
    return summary


class RoundLines:
    """Prints a line as each round (turn) of a lockstep run finishes: its requests, from
    the first sent to the last answer, and how many of their prompt tokens were cached."""

    def __init__(self, requests: list[Any]) -> None:
        self.left = Counter(r.turn for r in requests)
        self.rounds = len(self.left)
        self.records: dict[int, list[RequestRecord]] = defaultdict(list)

    def finished(self, record: RequestRecord) -> None:
        turn = record.turn
        self.records[turn].append(record)
        self.left[turn] -= 1
        if self.left[turn]:
            return
        recs = self.records.pop(turn)
        seconds = max(r.end_s or r.sent_s for r in recs) - min(r.sent_s for r in recs)
        cached = sum(r.cached_tokens or 0 for r in recs)
        prompt = sum(r.prompt_tokens for r in recs)
        print(f"round {turn + 1}/{self.rounds}: {len(recs)} requests in {seconds:.2f} s, "
              f"{cached}/{prompt} prompt tokens cached", flush=True)


def _oracle(requests: list[Any], run: RunOutput, report: Report) -> dict[str, Any]:
    """Hit rates an ideal and an LRU cache would reach on the stream as it ran; fills each
    record's ``expected_cached_tokens``."""
    by_index = {r.index: r for r in requests}
    stream = [OracleRequest(rec.index, by_index[rec.index].cache_salt,
                            by_index[rec.index].extra_key, run.prompts[rec.index],
                            run.answers.get(rec.index, ()), rec.sent_s,
                            rec.end_s if rec.ok else None)
              for rec in run.records if rec.index in run.prompts]
    capacity = None if report.lru_capacity_tokens is None \
        else report.lru_capacity_tokens // report.page_size
    result = simulate(stream, page_size=report.page_size, capacity_pages=capacity)
    for rec in run.records:
        rec.expected_cached_tokens = result.ideal_hit_tokens.get(rec.index)
    return {"ideal_hit_rate": result.ideal_hit_rate, "lru_hit_rate": result.lru_hit_rate,
            "lru_capacity_tokens": report.lru_capacity_tokens, "page_size": report.page_size,
            "prompt_tokens": result.prompt_tokens}


async def _settled(server: Server) -> dict | None:
    """The server's counters once they stopped changing (``None``: no metrics URL)."""
    if server.metrics_url is None:
        return None
    return await asyncio.to_thread(wait_for_export, server.metrics_url,
                                   interval_s=server.export_interval_s,
                                   timeout_s=6 * server.export_interval_s)


def _plot(run: RunOutput, summary: dict[str, Any], out_dir: Path) -> None:
    from pd_cache.app.bench.plots import plot_run

    try:
        plot_run(run.records, summary, out_dir)
    except RuntimeError as exc:   # matplotlib missing: the numbers are written anyway
        print(f"pd-cache bench: no plots: {exc}", file=sys.stderr)


def compare_outputs(on: Server, off: Server) -> list[dict[str, Any]]:
    """Per rate, the requests both runs answered and how many got different tokens: the
    cache must change no output (greedy decoding, the same prompts)."""
    out = []
    for rate, answers in on.answers.items():
        other = off.answers.get(rate, {})
        both = answers.keys() & other.keys()
        out.append({"rate": _rate_json(rate), "compared": len(both),
                    "mismatched": sum(answers[i] != other[i] for i in both)})
    return out


def write_sweep(summaries: list[dict[str, Any]], output_dir: Path, plots: bool,
                comparison: list[dict[str, Any]] | None = None) -> Path:
    """``sweep.json`` (every run's config and flat figures, and the cache on/off output
    comparison) and ``sweep.png``; prints the sweep table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "sweep.json"
    doc = {"schema_version": SCHEMA_VERSION,
           "runs": [{"config": s["config"], "flat": s["flat"]} for s in summaries],
           "outputs_compared": comparison}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if plots:
        from pd_cache.app.bench.plots import plot_sweep
        try:
            plot_sweep(summaries, output_dir)
        except RuntimeError as exc:
            print(f"pd-cache bench: no plots: {exc}", file=sys.stderr)
    print(f"\n{format_sweep(summaries)}", flush=True)
    for row in comparison or []:
        print(f"rate {row['rate']}: cache on vs off, {row['mismatched']} of {row['compared']} "
              f"answers differ", flush=True)
    return path


class _NoBar:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5,
                dynamic_ncols=True)


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else float(rate)
