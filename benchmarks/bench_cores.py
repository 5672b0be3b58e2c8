"""Idle cores lent to the worker that has work (``ClusterConfig.lend_cores``), on vs off.

``pd-cache bench`` drives an in-process cluster (2 prefill + 2 decode workers, one torch
thread each, 2 L3 shards) with independent 1,024-token prompts (no reuse: every prompt is
computed whole) and 16 output tokens, Poisson arrivals at each rate of ``--rates``: at 0.5
req/s the requests come one at a time (a prefill finds the node idle and borrows its other
core), at 4 req/s they overlap (there is little idle to lend, and lending must not cost).
Both settings see the same arrivals. Repeats alternate the two settings (``--repeats``,
default 3); the figures are medians over the repeats. Tokens are not compared here: the
integration suite's clusters lend cores (the default) and check every answer against the
model's own.

Writes benchmarks/results/cores.json: per rate, TTFT p50/p90, TPOT p90 and throughput with
lending on and off, and ``ttft_p50_ratio`` (on / off) per rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.bench.cli import main as bench_main

SEED = 1234
RESULTS = Path(__file__).parent / "results" / "cores.json"
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p90_ms", "request_throughput")


def run(lend: bool, rates: str, model: str, requests: int, out: Path) -> dict[float, dict]:
    """One sweep of ``rates`` with lending on or off: figures by rate."""
    argv = ["--model", model, "--workload", "random", "--input-len", "1024",
            "--output-len", "16", "--num-requests", str(requests), "--request-rate", rates,
            "--seed", str(SEED), "--warmup-requests", "2", "--output-dir", str(out),
            "--no-plots", "--lend-cores" if lend else "--no-lend-cores"]
    status = bench_main(argv)
    if status:
        raise SystemExit(f"pd-cache bench failed (exit {status})")
    figures = {}
    for path in sorted(out.glob("cache-*-rate*/summary.json")):
        s = json.loads(path.read_text())
        lat = s["results"]["latency_ms"]
        figures[float(s["config"]["rate"])] = {
            "ttft_p50_ms": lat["ttft"]["median"], "ttft_p90_ms": lat["ttft"]["p90"],
            "tpot_p90_ms": lat["tpot"]["p90"],
            "request_throughput": s["results"]["throughput"]["request_throughput"]}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="0.5,4")
    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()
    runs: dict[str, list[dict[float, dict]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="pd-cache-cores-") as tmp:
        for i in range(args.repeats):
            for mode in ("on", "off"):
                out = Path(tmp) / f"{mode}-{i}"
                runs[mode].append(run(mode == "on", args.rates, args.model, args.requests,
                                      out))
    rates = sorted(runs["on"][0])
    by_rate = {}
    for rate in rates:
        median = {mode: {k: statistics.median(r[rate][k] for r in runs[mode])
                         for k in FIGURES} for mode in runs}
        by_rate[str(rate)] = {**median, "ttft_p50_ratio":
                              median["on"]["ttft_p50_ms"] / median["off"]["ttft_p50_ms"],
                              "runs": {mode: [r[rate] for r in runs[mode]] for mode in runs}}
        on, off = median["on"], median["off"]
        print(f"rate {rate:>4}: TTFT p50 {on['ttft_p50_ms']:.0f} ms lent vs "
              f"{off['ttft_p50_ms']:.0f} ms not ({on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}x), "
              f"TPOT p90 {on['tpot_p90_ms']:.1f} vs {off['tpot_p90_ms']:.1f} ms, "
              f"{on['request_throughput']:.2f} vs {off['request_throughput']:.2f} req/s")
    write_result(RESULTS, {
        "benchmark": "lend_cores_zero_reuse", "seed": SEED, "model": args.model,
        "requests": args.requests, "repeats": args.repeats, "rates": by_rate,
        "load_average": load,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}})


if __name__ == "__main__":
    main()
