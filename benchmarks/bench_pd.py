"""The PD cluster with the cache on vs off, one multi-turn workload, side by side in one run.

Shape after SGLang's multi-turn benchmark, scaled to a 2-core machine: 4 tenants x 2
clients, a 1,024-token system prompt shared within each tenant, 4 rounds of 256 new user
tokens, 32 output tokens, small model; ``--scale`` multiplies tenants. Each mode gets its
own cluster (2 prefill + 2 decode, and 2 storage actors with the cache on) on one local Ray
instance, warmed up by one short request per worker before the clock starts. Both modes
must produce the same tokens, request by request.

Its bound, measured in the same run: the cache-off run's time minus the CPU time of the
prefill compute the cached tokens no longer need (their share of each request's forward,
timed here with the workload's own lengths), converted to wall time at the off run's own
core utilization; ``amdahl_bound_ratio`` = off time / bound, ``efficiency`` =
``throughput_ratio / amdahl_bound_ratio``. The CPU seconds each role (prefill, decode,
storage, the page index, Ray's raylet and GCS, this driver) used in each mode say where the
rest goes.

The load is ``pd-cache bench``'s closed loop (its multi-turn workload at rate inf, each
client sending its next turn when its own answer is in; ``--lockstep``: round by round) with
whole answers (``LocalTarget(stream=False)``: ``PDCluster.generate_async``, as before the
bench took this shape); every prompt starts with a 64-token preamble shared by all tenants.

``--repeats N``: N on/off pairs, their order alternating; the JSON is the pair whose
``efficiency_strict`` is the median, with every pair's figures (``pairs``) and each headline
figure's median (``medians``). The targets are medians of 3 (``--repeats 3``).

Writes benchmarks/results/pd.json (``throughput_ratio`` and ``ttft_p50_ratio`` are on/off;
``storage_calls_per_request``: the L3 calls the shards answered during the cache-on run,
as they count them, per request; ``index_queries_per_request``: the page index shards' queries
per request, 0 without an index (``--index-shards``) or while each front's mirror answers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from pathlib import Path

from core_timeline import (
    Timeline,
    by_worker,
    describe,
    phases,
    process_cpu,
    role_cpu,
    run_bounds,
)
from results_io import write_result  # this folder: the tail every benchmark shares
from thread_cpu import kernel_side, thread_cpu, thread_cpu_delta  # this folder

from pd_cache import ClusterConfig, PDCluster, Req
from pd_cache.app.bench.runner import run_open_loop
from pd_cache.app.bench.targets import LocalTarget
from pd_cache.app.bench.workloads import Workload, multi_turn_workload
from pd_cache.app.run import percentile
from pd_cache.app.session import ray_session
from pd_cache.core.wire import totals

SEED = 1234
RESULTS = Path(__file__).parent / "results" / "pd.json"


def warm_up(cluster: PDCluster) -> None:
    """One short request through every worker (its own namespace): first-call costs out."""
    for i in range(max(len(cluster.prefill), len(cluster.decode))):
        req = Req(rid=f"warm-{i}", input_ids=list(range(100 + i, 164 + i)),
                  cache_salt="bench-warm-up", max_new_tokens=4)
        cluster.generate(req, prefill_worker=i % len(cluster.prefill),
                         decode_worker=i % len(cluster.decode))
    cluster.flush()


def actor_pids(cluster: PDCluster) -> dict[str, list[int]]:
    """Each role's processes, and Ray's own (raylet, GCS) as ``ray``."""
    import ray

    return {"prefill": ray.get([a.pid.remote() for a in cluster.prefill]),
            "decode": ray.get([a.pid.remote() for a in cluster.decode]),
            "storage": ray.get([s.ping.remote() for s in cluster.storage]),
            "index": ray.get([a.pid.remote() for a in cluster.index_actors]),
            "ray": [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                    and _comm(p) in ("raylet", "gcs_server")]}


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def workload(wl: dict) -> Workload:
    """The bench's multi-turn stream of ``wl`` (``main``'s shape)."""
    return multi_turn_workload(wl["tenants"], wl["clients_per_tenant"], wl["rounds"],
                               system_tokens=wl["system_tokens"],
                               user_tokens=wl["user_tokens"], output_tokens=wl["output_tokens"],
                               vocab_size=wl["vocab_size"], seed=wl["seed"],
                               preamble_tokens=wl["preamble_tokens"])


def measure(cfg: ClusterConfig, stream: Workload, lockstep: bool) -> dict:
    cluster = PDCluster.start(cfg)
    try:
        warm_up(cluster)
        pids = actor_pids(cluster)
        cpu_before, driver_before = role_cpu(pids), _own_cpu()
        threads_before = {r: thread_cpu(pids[r]) for r in ("prefill", "storage")}
        kernel_before = {r: kernel_side(p) for r, p in pids.items()}
        calls_before, grants_before = cluster.l3_calls(), grant_calls(cluster)
        queries_before = index_queries(cluster)
        target = LocalTarget(cluster, stream=False)
        timeline = Timeline(by_worker({**pids, "driver": [os.getpid()]}, "decode"))
        start = timeline.start_s = time.perf_counter()
        timeline.start()
        run = asyncio.run(run_open_loop(target, stream.requests, [0.0] * len(stream.requests),
                                        lockstep=lockstep))
        seconds = time.perf_counter() - start
        prefilled = [r.sent_s + target.completions[r.index].ttft_s for r in run.records
                     if r.ok]
        cores = phases(timeline.stop(), run_bounds(prefilled, seconds), os.cpu_count() or 1)
        cluster.flush()
        cpu = {role: t - cpu_before[role] for role, t in role_cpu(pids).items()}
        cpu["driver"] = _own_cpu() - driver_before
        threads = {r: thread_cpu_delta(b, thread_cpu(pids[r])) for r, b in threads_before.items()}
        kernel = {r: [now - was for now, was in zip(kernel_side(pids[r]), b)]
                  for r, b in kernel_before.items()}
        writes = {**cluster.l3_writes(), **page_kinds(cluster.engine_stats())}
        calls = {op: n - calls_before[op] for op, n in cluster.l3_calls().items()}
        calls["arena_grant"] = grant_calls(cluster) - grants_before   # not an L3 op: apart
        queries = index_queries(cluster) - queries_before
    finally:
        cluster.shutdown()
    failed = [r.error for r in run.records if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, the first: {failed[0]}")
    done = [target.completions[r.index] for r in stream.requests]
    t = totals(done)
    ttft = [c.ttft_s for c in done]
    generated = sum(len(c.output_ids) for c in done)
    cached = sum(t["cached_tokens"].values())
    return {**handoff(cfg, done),
        "seconds": seconds, "requests": len(done),
        "requests_per_s": len(done) / seconds, "generated_tokens_per_s": generated / seconds,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "cached_tokens": t["cached_tokens"], "cached_tokens_total": cached,
        "prompt_tokens": t["prompt_tokens"], "cached_fraction": cached / t["prompt_tokens"],
        "pages_handed_off": t["pages_handed_off"], "l3_writes": writes,
        "storage_calls": calls, "storage_calls_per_request":
            sum(n for op, n in calls.items() if op != "arena_grant") / len(done),
        "index_queries_per_request": queries / len(done),
        "cross_namespace_tokens": t["cross_namespace_tokens"],
        "phases_p50_s": phases_p50(done), "cpu_seconds": cpu, "core_use": cores,
        "thread_cpu_seconds": threads,
        "page_faults": {r: k[0] for r, k in kernel.items()},
        "system_cpu_seconds": {r: round(k[1], 3) for r, k in kernel.items()},
        "prompts": {c.rid: (c.num_prompt_tokens, sum(c.cached_tokens.values()))
                    for c in done},
        "prefill_s": {c.rid: c.prefill_s for c in done},
        "outputs": {c.rid: c.output_ids for c in done},
    }


def grant_calls(cluster: PDCluster) -> int:
    """``arena_grant`` calls the shards answered so far (a set's slots, unless leased)."""
    import ray

    return sum(u.get("grant_calls", 0) for u in ray.get(
        [s.arena_usage.remote() for s in cluster.storage]))


def index_queries(cluster: PDCluster) -> int:
    """Queries the page index shards answered so far (0 without an index; a front that
    routes from its mirror asks none while the mirror is in sync)."""
    import ray

    return sum(s.get("query", 0) for s in ray.get(
        [a.stats.remote() for a in cluster.index_actors]))


def handoff(cfg: ClusterConfig, done: list) -> dict:
    """KV moved from prefill to decode against the prompts' pages, and what decode kept."""
    layout = cfg.pd_config.layout
    prompt_pages = sum(-(-c.num_prompt_tokens // layout.page_size) for c in done)
    sent = sum(c.pages_handed_off for c in done)
    return {"prompt_pages": prompt_pages, "pages_kept": sum(c.pages_kept for c in done),
            "handoff_page_fraction": sent / prompt_pages, "page_bytes": layout.page_nbytes,
            "handoff_bytes_per_request": sent * layout.page_nbytes / len(done)}


def page_kinds(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    """Decode's offloaded pages by kind (``offload_prompt``: prompt pages L3 was said to
    lack; ``offload_generated``), summed over the workers."""
    return {f"offload_{kind}": sum(s.get(f"offload/{kind}", 0) for s in stats.values())
            for kind in ("prompt", "generated")}


def _own_cpu() -> float:
    return process_cpu(os.getpid())


def saved_fractions(model_name: str, prompts: dict[str, tuple[int, int]],
                    repeats: int = 2) -> dict[str, float]:
    """Per request of the cache-on run (prompt ``n`` tokens, ``c`` of them cached), the
    share of its prefill compute the cached tokens no longer need, measured here with the
    workload's own lengths: 1 - forward(last n - c tokens after a c-token prefix) /
    forward(all n); one thread, as each worker runs; fastest of ``repeats``."""
    import torch

    from pd_cache.core.config import ModelConfig
    from pd_cache.model.model import Model

    torch.set_num_threads(1)
    cfg = ModelConfig.preset(model_name)
    model = Model(cfg)
    g = torch.Generator().manual_seed(SEED)
    out = {}
    for rid, (n, c) in prompts.items():
        if not c:
            out[rid] = 0.0
            continue
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        past = model.forward(ids[:c]).kv
        full = min(_timed(model, ids, None) for _ in range(repeats))
        part = min(_timed(model, ids[c:], past) for _ in range(repeats))
        out[rid] = max(0.0, 1.0 - part / full)
    return out


def _timed(model, ids: list[int], past) -> float:
    start = time.perf_counter()
    model.forward(ids, past)
    return time.perf_counter() - start


def strict_bound_cpu(on: dict[str, float], off: dict[str, float], saved: float) -> float:
    """CPU seconds of a cache with no cost of its own: the off run's prefill less ``saved``,
    every other role at the cheaper of the two runs (decode batches fill better when
    prefill is fast), storage and the page index at zero (they exist only for the cache)."""
    rest = sum(min(on[role], off.get(role, 0.0)) for role in on
               if role not in ("prefill", "storage", "index"))
    return off["prefill"] - saved + rest


def phases_p50(done: list) -> dict[str, float]:
    """Median seconds per phase: the prefill worker's own time, the wait for a prefill
    worker (TTFT minus it, the router and Ray included), KV handoff, batched decode."""
    return {"prefill": percentile([c.prefill_s for c in done], 50),
            "prefill_queue": percentile([c.ttft_s - c.prefill_s for c in done], 50),
            "handoff": percentile([c.handoff_s for c in done], 50),
            "decode": percentile([c.decode_s for c in done], 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=1, help="multiply the tenants")
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode-batch", type=int, default=ClusterConfig.decode_batch,
                        help="requests a decode worker steps together (1: one at a time); "
                             "the same in both modes")
    parser.add_argument("--decode-pack", action=argparse.BooleanOptionalAction, default=True,
                        help="route decode to the busiest worker with batch room (fuller "
                             "batches) instead of the least loaded; the same in both modes")
    parser.add_argument("--offload-min-pages", type=int, default=2,
                        help="decode's last write of a request only if it sends this many "
                             "pages (ClusterConfig.offload_min_pages; 2: an answer's lone "
                             "page is recomputed, not offloaded)")
    parser.add_argument("--index-shards", type=int, default=0,
                        help="page index actors with the cache on (ClusterConfig.index_shards; "
                             "0: none, prefill reads L3 past its local hit unasked); "
                             "index_mirror_s as configured")
    parser.add_argument("--spread-cores", type=int, default=ClusterConfig.decode_spread_cores,
                        help="ClusterConfig.decode_spread_cores; the same in both modes")
    parser.add_argument("--threads", type=int, default=ClusterConfig.threads,
                        help="torch threads per worker; the same in both modes")
    parser.add_argument("--lend-cores", action=argparse.BooleanOptionalAction,
                        default=ClusterConfig.lend_cores,
                        help="ClusterConfig.lend_cores: a forward borrows the cores the other "
                             "workers leave idle; the same in both modes")
    parser.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=False,
                        help="rounds in lockstep (every client waits for the whole round) "
                             "instead of each client sending its next turn when its own "
                             "answer is in; the same in both modes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="on/off pairs, their order alternating (on first, then off "
                             "first, ...); the JSON is the median pair by efficiency_strict, "
                             "with every pair's figures and each figure's median")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    wl = {"tenants": 4 * args.scale, "clients_per_tenant": 2, "system_tokens": 1024,
          "rounds": args.rounds, "user_tokens": 256, "output_tokens": 32,
          "preamble_tokens": 64, "vocab_size": 4096,
          "seed": SEED}
    stream = workload(wl)
    base = ClusterConfig(model=args.model, device_pages=512, host_pages=2048,
                         decode_batch=args.decode_batch, decode_pack=args.decode_pack,
                         threads=args.threads, lend_cores=args.lend_cores,
                         offload_min_pages=args.offload_min_pages,
                         decode_spread_cores=args.spread_cores)
    # NOTE: the index exists for the cache alone: the off run starts none.
    with_index = {"index_shards": args.index_shards}
    runs = []
    with ray_session(None):
        for rep in range(args.repeats):
            # NOTE: a drift in the machine's speed over a pair weighs on the mode measured
            # second; alternating the order spreads it over both modes.
            order = ("on", "off") if rep % 2 == 0 else ("off", "on")
            if args.repeats > 1:
                print(f"pair {rep + 1} of {args.repeats} ({order[0]} first)", flush=True)
            load = os.getloadavg()
            results = {mode: run_mode(base, with_index, mode, stream, args.lockstep)
                       for mode in order}
            runs.append(compare(args, wl, stream, results, load, order))
    out = median_pair(runs)
    write_result(RESULTS, out, show=None)
    if not all(run["outputs_equal"] for run in runs):
        raise SystemExit("cache on and off produced different tokens")


def run_mode(base: ClusterConfig, with_index: dict, mode: str, stream: Workload,
             lockstep: bool) -> dict:
    """One mode's cluster measured on ``stream``, its figures printed."""
    cache = mode == "on"
    cfg = ClusterConfig(**{**base.__dict__, "cache": cache, **(with_index if cache else {})})
    r = measure(cfg, stream, lockstep)
    print(f"cache {mode:>3}: {r['seconds']:.2f} s, {r['requests_per_s']:.2f} req/s, "
          f"{r['generated_tokens_per_s']:.1f} tok/s, TTFT p50 "
          f"{r['ttft_p50_s'] * 1e3:.1f} ms p90 {r['ttft_p90_s'] * 1e3:.1f} ms, "
          f"cached {r['cached_tokens']}", flush=True)
    print("          phase p50 (ms): " + ", ".join(
        f"{k} {v * 1e3:.0f}" for k, v in r["phases_p50_s"].items()), flush=True)
    describe(mode, r["core_use"])
    return r


def compare(args: argparse.Namespace, wl: dict, stream: Workload, results: dict,
            load: tuple[float, ...], order: tuple[str, ...]) -> dict:
    """One pair's result: the two modes side by side, the bounds, what each role spent."""
    on, off = results["on"], results["off"]
    same = on.pop("outputs") == off.pop("outputs")
    # The bound: the cache-off run's time minus the compute the cached tokens no longer
    # need. That compute is CPU time: the off run's prefill CPU seconds, times the share of
    # each request's prefill the cached tokens account for (measured above with the
    # workload's lengths; requests weighted by their prefill time in the off run). The off
    # run kept the machine's cores busy at some utilization; taking S CPU seconds out of it
    # shortens it by S x (its wall time / its CPU seconds). Everything else (decode,
    # handoff, L3 writes and reads, offload, Ray, all of the on run's extra CPU) is counted
    # against pd-cache. (A per-request wall-time version overstates the saving: a prefill
    # call's wall time on a busy machine includes waiting for a core.)
    fractions = saved_fractions(args.model, on.pop("prompts"))
    off.pop("prompts")
    off_prefill = off.pop("prefill_s")
    on.pop("prefill_s")
    share = sum(off_prefill[rid] * f for rid, f in fractions.items()) / sum(off_prefill.values())
    off_cpu = sum(off["cpu_seconds"].values())
    saved_cpu = off["cpu_seconds"]["prefill"] * share
    bound_s = off["seconds"] * (off_cpu - saved_cpu) / off_cpu
    lanes = os.cpu_count() or 1
    strict_cpu = strict_bound_cpu(on["cpu_seconds"], off["cpu_seconds"], saved_cpu)
    strict_s = off["seconds"] * strict_cpu / off_cpu
    saved = {"saved_prefill_share": share, "saved_cpu_s": saved_cpu, "off_cpu_s": off_cpu,
             "off_utilization": off_cpu / (off["seconds"] * lanes),
             "on_cpu_s": sum(on["cpu_seconds"].values()),
             "on_utilization": sum(on["cpu_seconds"].values()) / (on["seconds"] * lanes),
             "strict_bound_cpu_s": strict_cpu,
             "mean_saved_fraction": sum(fractions.values()) / len(fractions)}
    out = {
        "benchmark": "pd_cluster_multi_turn", "seed": SEED, "model": args.model,
        "workload": {**wl, "stream": stream.describe(), "lockstep": args.lockstep},
        "decode_batch": args.decode_batch, "offload_min_pages": args.offload_min_pages,
        "decode_pack": args.decode_pack, "decode_spread_cores": args.spread_cores,
        "index_shards": args.index_shards, "lend_cores": args.lend_cores,
        "load_average": load, "order": list(order),
        "machine": {"cpus": os.cpu_count(),
                                             "python": platform.python_version()},
        "on": on, "off": off, "outputs_equal": same,
        "throughput_ratio": on["requests_per_s"] / off["requests_per_s"],
        "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"],
        "ttft_p90_ratio": on["ttft_p90_s"] / off["ttft_p90_s"],
        "saved_prefill": saved, "bound_seconds": bound_s,
        "target": {"throughput_ratio": ">= 2", "ttft_p50_ratio": "<= 0.4",
                   "efficiency": ">= 0.9", "storage_calls_per_request": "<= 3",
                   "efficiency_strict": ">= 0.9"},
        "storage_calls_per_request": on["storage_calls_per_request"],
        "index_queries_per_request": on["index_queries_per_request"],
    }
    out["amdahl_bound_ratio"] = off["seconds"] / bound_s
    out["efficiency"] = out["throughput_ratio"] / out["amdahl_bound_ratio"]
    out["strict_bound_seconds"] = strict_s
    out["strict_bound_ratio"] = off["seconds"] / strict_s
    out["efficiency_strict"] = strict_s / on["seconds"]
    # NOTE: efficiency_strict is their product exactly: what the on run spent beyond a
    # free cache's CPU, and how well it kept the cores busy against the off run.
    out["strict_factors"] = {"cpu": strict_cpu / saved["on_cpu_s"],
                             "core_use": saved["on_utilization"] / saved["off_utilization"]}
    out["target_met"] = out["throughput_ratio"] >= 2 and out["ttft_p50_ratio"] <= 0.4 \
        and out["efficiency"] >= 0.9
    for mode in ("on", "off"):
        print(f"cache {mode:>3}: CPU s by role " + ", ".join(
            f"{k} {v:.1f}" for k, v in results[mode]["cpu_seconds"].items()))
        print("          page faults (system CPU s) by role " + ", ".join(
            f"{k} {n} ({results[mode]['system_cpu_seconds'][k]:.2f})"
            for k, n in results[mode]["page_faults"].items()))
        for role, spent in results[mode]["thread_cpu_seconds"].items():
            print(f"          {role} threads: " + ", ".join(
                f"{k} {v:.2f}" for k, v in list(spent.items())[:8]))
    print(f"saved prefill CPU {saved_cpu:.2f} s ({share:.0%} of prefill) of {off_cpu:.2f} s "
          f"(off run at {saved['off_utilization']:.0%} of {lanes} cores): bound "
          f"{bound_s:.2f} s vs off {off['seconds']:.2f} s, on {on['seconds']:.2f} s "
          f"using {saved['on_cpu_s']:.2f} CPU s")
    print(f"throughput on/off {out['throughput_ratio']:.2f}x (bound "
          f"{out['amdahl_bound_ratio']:.2f}x, efficiency {out['efficiency']:.2f}; strict bound "
          f"{out['strict_bound_ratio']:.2f}x, efficiency {out['efficiency_strict']:.2f}), TTFT p50 "
          f"on/off {out['ttft_p50_ratio']:.2f}x, outputs equal: {same}, target met: "
          f"{out['target_met']}")
    print(f"strict efficiency = CPU factor {out['strict_factors']['cpu']:.3f} (strict bound "
          f"{strict_cpu:.2f} CPU s / on {saved['on_cpu_s']:.2f}) x core-use factor "
          f"{out['strict_factors']['core_use']:.3f} (on {saved['on_utilization']:.0%} / off "
          f"{saved['off_utilization']:.0%} of the cores)")
    print(f"L3 calls per request (at the shards) {on['storage_calls_per_request']:.2f}: "
          + ", ".join(f"{op} {n}" for op, n in on["storage_calls"].items()))
    return out


# The figures whose medians over the pairs the JSON gives (``medians``), each pair's too
# (``pairs``).
PAIR_FIGURES = ("efficiency_strict", "throughput_ratio", "ttft_p50_ratio", "efficiency",
                "storage_calls_per_request", "index_queries_per_request")


def median_pair(runs: list[dict]) -> dict:
    """The pair whose ``efficiency_strict`` is the median (the lower middle of an even
    count), with ``pairs`` (every pair's figures, in run order) and ``medians``."""
    at = sorted(range(len(runs)), key=lambda i: runs[i]["efficiency_strict"])[
        (len(runs) - 1) // 2]
    pairs = [{"order": run["order"], "load_average": run["load_average"],
              "on_seconds": run["on"]["seconds"], "off_seconds": run["off"]["seconds"],
              "on_cpu_seconds": run["on"]["cpu_seconds"],
              "off_cpu_seconds": run["off"]["cpu_seconds"],
              "strict_factors": run["strict_factors"], "outputs_equal": run["outputs_equal"],
              **{k: run[k] for k in PAIR_FIGURES}} for run in runs]
    medians = {k: statistics.median(run[k] for run in runs) for k in PAIR_FIGURES}
    if len(runs) > 1:
        print(f"{len(runs)} pairs: efficiency_strict " + " / ".join(
            f"{run['efficiency_strict']:.3f}" for run in runs)
            + f" (median {medians['efficiency_strict']:.3f}); throughput on/off median "
            f"{medians['throughput_ratio']:.2f}x; the JSON is pair {at + 1}")
    return {**runs[at], "pairs": pairs, "medians": medians}


if __name__ == "__main__":
    main()
