"""Decode's prefix cache on vs off: bench_pd's multi-turn workload, side by side in one run.

Both modes run the cache at every tier (``cache`` on); they differ only in ``decode_cache``:
on, a conversation's next turn goes back to the decode worker that kept its previous turn
and prefill hands over only the pages after what that worker holds; off, every turn ships
its whole prompt. Reported per mode (medians of ``--repeats`` runs, the modes interleaved
on one Ray instance, a fresh cluster per run): ``handoff_page_fraction`` (pages handed off /
prompt pages), ``handoff_bytes_per_request``, throughput, TTFT p50 and the median of each
phase (the wait for a prefill worker, prefill's compute, the handoff, decode); ratios
on/off. Both modes must produce the same tokens, request by request.

Two rows: the small model at bench_pd's page size (32 KiB pages), and the same model with
128-token pages (256 KiB a page: the KV one page of a 1B-class model holds) to show what
the saved bytes are worth in handoff time.

Writes benchmarks/results/decode_cache.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

from bench_pd import SEED, measure, workload
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache import ClusterConfig
from pd_cache.app.session import ray_session

RESULTS = Path(__file__).parent / "results" / "decode_cache.json"
FIGURES = ("handoff_page_fraction", "handoff_bytes_per_request", "requests_per_s",
           "ttft_p50_s", "handoff_p50_s", "seconds")


def one_run(cfg: ClusterConfig, stream, lockstep: bool) -> dict:
    r = measure(cfg, stream, lockstep)
    keep = {k: r[k] for k in FIGURES if k in r}
    # NOTE: where the time goes: TTFT p50 = the wait for a prefill worker (queue, router,
    # Ray; prefill's wait on decode's reservation) + prefill's own compute.
    for phase, p50 in r["phases_p50_s"].items():
        keep[f"{phase}_p50_s"] = p50
    keep["pages_kept"], keep["prompt_pages"] = r["pages_kept"], r["prompt_pages"]
    keep["page_bytes"], keep["outputs"] = r["page_bytes"], r["outputs"]
    return keep


def row(base: ClusterConfig, stream, repeats: int, lockstep: bool) -> dict:
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(repeats):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")   # NOTE: interleaved
        for mode in order:
            cfg = ClusterConfig(**{**base.__dict__, "decode_cache": mode == "on"})
            runs[mode].append(one_run(cfg, stream, lockstep))
            r = runs[mode][-1]
            print(f"  page {base.page_size:>3} decode cache {mode:>3}: "
                  f"{r['requests_per_s']:.2f} req/s, TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms, "
                  f"(queue {r['prefill_queue_p50_s'] * 1e3:.1f} + prefill "
                  f"{r['prefill_p50_s'] * 1e3:.1f}), decode {r['decode_p50_s'] * 1e3:.1f} ms, "
                  f"handoff p50 {r['handoff_p50_s'] * 1e3:.2f} ms, pages "
                  f"{r['handoff_page_fraction']:.2f} of the prompts', "
                  f"{r['handoff_bytes_per_request'] / 2**20:.2f} MiB/request", flush=True)
    outputs = [r.pop("outputs") for mode in runs for r in runs[mode]]
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for mode, rs in runs.items()}
    on, off = med["on"], med["off"]
    return {"page_size": base.page_size, "page_bytes": on["page_bytes"], "runs": runs,
            "median": med, "outputs_equal": all(o == outputs[0] for o in outputs),
            "throughput_ratio": on["requests_per_s"] / off["requests_per_s"],
            "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"],
            "handoff_p50_ratio": on["handoff_p50_s"] / off["handoff_p50_s"],
            "handoff_bytes_ratio": on["handoff_bytes_per_request"]
            / off["handoff_bytes_per_request"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-sizes", default="16,128")
    parser.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=False)
    args = parser.parse_args()
    wl = {"tenants": 4, "clients_per_tenant": 2, "system_tokens": 1024, "rounds": args.rounds,
          "user_tokens": 256, "output_tokens": 32, "preamble_tokens": 64, "vocab_size": 4096,
          "seed": SEED}
    stream = workload(wl)
    rows = []
    with ray_session(None):
        for ps in (int(p) for p in args.page_sizes.split(",")):
            base = ClusterConfig(model=args.model, page_size=ps, device_pages=512 * 16 // ps,
                                 host_pages=2048 * 16 // ps, decode_pack=True)
            rows.append(row(base, stream, args.repeats, args.lockstep))
    for r in rows:
        on, off = r["median"]["on"], r["median"]["off"]
        print(f"page {r['page_size']:>3} ({r['page_bytes'] // 1024} KiB): handoff pages "
              f"{on['handoff_page_fraction']:.2f} vs {off['handoff_page_fraction']:.2f}, "
              f"{on['handoff_bytes_per_request'] / 2**20:.2f} vs "
              f"{off['handoff_bytes_per_request'] / 2**20:.2f} MiB/request, handoff p50 "
              f"{r['handoff_p50_ratio']:.2f}x, throughput {r['throughput_ratio']:.2f}x, "
              f"TTFT p50 {r['ttft_p50_ratio']:.2f}x, outputs equal: {r['outputs_equal']}")
    first = rows[0]
    out = {"benchmark": "decode_cache_multi_turn", "seed": SEED, "model": args.model,
           "workload": {**wl, "stream": stream.describe(), "lockstep": args.lockstep},
           "repeats": args.repeats, "machine": {"cpus": os.cpu_count(),
                                                "python": platform.python_version()},
           "rows": rows,
           "handoff_page_fraction": first["median"]["on"]["handoff_page_fraction"],
           "handoff_bytes_per_request": first["median"]["on"]["handoff_bytes_per_request"],
           "throughput_ratio": first["throughput_ratio"],
           "ttft_p50_ratio": first["ttft_p50_ratio"],
           "target": {"handoff_page_fraction": "<= 0.30", "throughput_ratio": ">= 0.95",
                      "ttft_p50_ratio": "<= 1.05"}}
    out["target_met"] = (out["handoff_page_fraction"] <= 0.30
                         and out["throughput_ratio"] >= 0.95 and out["ttft_p50_ratio"] <= 1.05)
    write_result(RESULTS, out, show=None)
    print(f"target met: {out['target_met']}")
    if not all(r["outputs_equal"] for r in rows):
        raise SystemExit("decode cache on and off produced different tokens")


if __name__ == "__main__":
    main()
