"""Serving under load: a request-rate sweep of multi-turn chat, cache on vs off, one run.

``pd-cache bench`` drives an in-process cluster (2 prefill + 2 decode workers, 2 L3
shards with the cache on) with 4 tenants x 4 users x 3 turns of chat: a 1,024-token
system prompt per tenant, 128 new user tokens and 32 output tokens a turn, turns
interleaved at random, Poisson arrivals at each rate. Both modes see the same arrivals and
must give the same tokens. The SLO is fixed here: TTFT p90 <= 1 s and TPOT p90 <= 200 ms
for a rate to count as sustained; a request is good when its own TTFT and TPOT are within
those bounds.

Writes benchmarks/results/serving.json: ``max_rate_at_slo_on`` / ``_off`` (the highest
rate of the sweep whose p90s meet the SLO), ``goodput_ratio`` (good requests/s on / off at
the highest rate both ran) and ``ttft_p50_ratio`` (on / off, same rate), with every run's
figures. Target: goodput_ratio >= 3.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.bench.cli import main as bench_main

SEED = 1234
SLO = {"ttft_p90_ms": 1000.0, "tpot_p90_ms": 200.0}
RESULTS = Path(__file__).parent / "results" / "serving.json"


def sweep(rates: str, model: str, out: Path) -> list[dict]:
    argv = ["--model", model, "--workload", "multi-turn", "--tenants", "4", "--users", "4",
            "--rounds", "3", "--system-len", "1024", "--user-tokens", "128",
            "--output-len", "32", "--turn-order", "random", "--request-rate", rates,
            "--seed", str(SEED), "--warmup-requests", "4", "--compare-no-cache",
            "--slo-ttft-ms", str(SLO["ttft_p90_ms"]), "--slo-tpot-ms",
            str(SLO["tpot_p90_ms"]), "--output-dir", str(out), "--no-plots"]
    status = bench_main(argv)
    if status:
        raise SystemExit(f"pd-cache bench failed (exit {status}): answers differ or leaked")
    runs = []
    for path in sorted(out.glob("cache-*-rate*/summary.json")):
        s = json.loads(path.read_text())
        lat, cfg = s["results"]["latency_ms"], s["config"]
        runs.append({"cache": cfg["cache"], "rate": cfg["rate"],
                     "ttft_p50_ms": lat["ttft"]["median"], "ttft_p90_ms": lat["ttft"]["p90"],
                     "tpot_p90_ms": lat["tpot"]["p90"],
                     "request_throughput": s["results"]["throughput"]["request_throughput"],
                     "request_goodput": s["results"]["throughput"]["request_goodput"],
                     "hit_rate": s["results"]["cache"]["client"]["hit_rate"],
                     "meets_slo": meets(lat)})
    return sorted(runs, key=lambda r: (not r["cache"], r["rate"]))


def meets(lat: dict) -> bool:
    ttft, tpot = lat["ttft"]["p90"], lat["tpot"]["p90"]
    return ttft is not None and ttft <= SLO["ttft_p90_ms"] and \
        (tpot is None or tpot <= SLO["tpot_p90_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", default="2,4,8,16")
    parser.add_argument("--model", default="small")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pd-cache-serving-") as tmp:
        runs = sweep(args.rates, args.model, Path(tmp))
    on = {r["rate"]: r for r in runs if r["cache"]}
    off = {r["rate"]: r for r in runs if not r["cache"]}
    top = max(set(on) & set(off))

    def best(mode: dict) -> float | None:
        ok = [rate for rate, r in mode.items() if r["meets_slo"]]
        return max(ok) if ok else None

    out = {
        "benchmark": "serving_multi_turn_rate_sweep", "seed": SEED, "model": args.model,
        "slo": SLO, "rates": sorted(on), "runs": runs,
        "max_rate_at_slo_on": best(on), "max_rate_at_slo_off": best(off),
        "ratio_rate": top,
        "goodput_ratio": on[top]["request_goodput"] / off[top]["request_goodput"]
        if off[top]["request_goodput"] else None,
        "ttft_p50_ratio": on[top]["ttft_p50_ms"] / off[top]["ttft_p50_ms"],
        "target": {"goodput_ratio": ">= 3"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    ratio = out["goodput_ratio"]
    out["target_met"] = ratio is None or ratio >= 3
    for r in runs:
        print(f"cache {'on ' if r['cache'] else 'off'} rate {r['rate']:>4}: "
              f"goodput {r['request_goodput']:.2f} req/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms "
              f"p90 {r['ttft_p90_ms']:.0f} ms, TPOT p90 {r['tpot_p90_ms']:.0f} ms, "
              f"hit {r['hit_rate']:.0%}, SLO {'met' if r['meets_slo'] else 'missed'}")
    print(f"max rate at SLO: on {out['max_rate_at_slo_on']}, off {out['max_rate_at_slo_off']}; "
          f"at rate {top}: goodput on/off "
          f"{'inf' if ratio is None else f'{ratio:.2f}x'}, TTFT p50 on/off "
          f"{out['ttft_p50_ratio']:.2f}x; target met: {out['target_met']}")
    write_result(RESULTS, out, show=None)


if __name__ == "__main__":
    main()
