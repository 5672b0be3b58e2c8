"""``pd-cache bench``: an open-loop load generator for prefix-heavy, multi-tenant,
multi-turn traffic, against an in-process cluster (``--target local``) or any
OpenAI-compatible server (``--target URL``). ``pd-cache bench make-trace`` writes a
synthetic Mooncake-format trace. ``python -m pd_cache.app.bench`` is the same command.

At ``--request-rate inf`` (the default) a multi-turn workload is a closed loop: every user at
once, each sending its next turn when its own answer is in; ``--lockstep`` puts a barrier
between rounds (``pd-cache run`` is that mode under its own flags).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pd_cache.app.bench.arrivals import PROCESSES, parse_rates
from pd_cache.app.bench.driver import Load, Report, Server, bench, compare_outputs, write_sweep
from pd_cache.app.bench.lengths import parse_length
from pd_cache.app.bench.summary import SLO
from pd_cache.app.bench.targets import DROP_ROUTE, HTTPTarget, LocalTarget
from pd_cache.app.bench.traces import make_trace, trace_workload
from pd_cache.app.bench.workloads import (
    TURN_ORDERS,
    Workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)
from pd_cache.app.flags import add_config_arguments, config_from_args
from pd_cache.core.cluster_config import ClusterConfig

WORKLOADS = ("multi-turn", "shared-prefix", "random", "trace")
HTTP_VOCAB = 256   # token ids every tokenizer has; pass --vocab-size for more


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="run", choices=("run", "make-trace"),
                        help="run a benchmark (default) or write a synthetic trace")
    parser.add_argument("--target", default="local",
                        help="'local' (an in-process PDCluster) or the base URL of an "
                             "OpenAI-compatible server (default: %(default)s)")
    parser.add_argument("--output-dir", default="bench-results", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    _workload_arguments(parser.add_argument_group("workload"))
    _load_arguments(parser.add_argument_group("load"))
    _server_arguments(parser.add_argument_group("server (--target URL)"))
    local = parser.add_argument_group("local target: the cluster")
    local.add_argument("--address", default=None,
                       help="join this Ray cluster instead of starting a local one")
    local.add_argument("--dashboard", action="store_true",
                       help="start the Ray dashboard with the local cluster (on 127.0.0.1)")
    local.add_argument("--compare-no-cache", action="store_true",
                       help="run the same arrivals again on a cluster with the cache off")
    local.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                       help="do not read the cluster's counters from the Ray metrics port "
                            "around each run (that waits for them to settle: seconds a run)")
    add_config_arguments(local, ClusterConfig)
    # NOTE: the shards export their counts every second, so a run's server delta is read
    # back soon after it ends (ClusterConfig's default of 5 s suits a long-lived server).
    parser.set_defaults(metrics_interval_s=1.0, model="tiny")


def _workload_arguments(g: Any) -> None:
    g.add_argument("--workload", default="multi-turn", choices=WORKLOADS)
    g.add_argument("--tenants", type=int, default=2)
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"token ids drawn from [0, N) (default: the model's; {HTTP_VOCAB} "
                        f"for a URL)")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests of the stream (random: its size; others: a cut)")
    g.add_argument("--input-len", default="256", help="random: N, uniform:LO:HI or "
                                                     "lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-len", default="32", help="output tokens (same forms)")
    g.add_argument("--groups", type=int, default=4, help="shared-prefix: groups")
    g.add_argument("--prompts-per-group", type=int, default=8)
    g.add_argument("--system-len", type=int, default=512,
                   help="shared-prefix and multi-turn: system prompt tokens")
    g.add_argument("--question-len", default="64", help="shared-prefix: question tokens")
    g.add_argument("--users", type=int, default=4, help="multi-turn: users per tenant")
    g.add_argument("--rounds", type=int, default=3, help="multi-turn: turns per user")
    g.add_argument("--user-tokens", type=int, default=64, help="multi-turn: new tokens a turn")
    g.add_argument("--preamble-len", type=int, default=0,
                   help="multi-turn: a platform preamble every prompt of every tenant starts "
                        "with (identical tokens in every namespace)")
    g.add_argument("--turn-order", default="round-robin", choices=TURN_ORDERS)
    g.add_argument("--trace", default=None, help="trace: a Mooncake-format JSONL file")
    g.add_argument("--trace-block-tokens", type=int, default=16)
    g.add_argument("--trace-source-block", type=int, default=512)
    g.add_argument("--max-output-tokens", type=int, default=64)
    g.add_argument("--time-scale", type=float, default=1.0)


def _load_arguments(g: Any) -> None:
    g.add_argument("--request-rate", default="inf",
                   help="req/s, 'inf', or a list for a sweep: 1,2,4,8 (default: %(default)s)")
    g.add_argument("--arrival", default="poisson", choices=PROCESSES)
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: < 1 burstier than Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--lockstep", action="store_true",
                   help="multi-turn: round by round, the next round once every answer of this "
                        "one is in (at rate inf: a closed loop's rounds)")
    g.add_argument("--duration", type=float, default=None,
                   help="keep only requests arriving in the first N seconds")
    g.add_argument("--warmup-requests", type=int, default=4)
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2el-ms", type=float, default=None)
    g.add_argument("--lru-capacity-tokens", type=int, default=None,
                   help="the oracle's LRU capacity (default, local: the L3 capacity)")


def _server_arguments(g: Any) -> None:
    g.add_argument("--api-key", action="append", default=[],
                   help="a key for every tenant, or repeat: tenant t uses key t %% count")
    g.add_argument("--admin-key", default=None,
                   help="the key that may empty the server's caches (default: the first "
                        "--api-key)")
    g.add_argument("--model-name", default=None,
                   help="the served model (default: the first of /v1/models)")
    g.add_argument("--metrics-url", default=None,
                   help="a Prometheus text endpoint of the server, for its counters")
    g.add_argument("--drop-caches-route", default=DROP_ROUTE,
                   help="admin route that empties the server's caches (vLLM: "
                        "/reset_prefix_cache, SGLang: /flush_cache)")
    g.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not empty the caches between warm-up and measurement")
    g.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text and only OpenAI's own fields (for servers "
                        "that refuse token ids or extensions: transformers serve)")
    g.add_argument("--page-size-hint", type=int, default=None,
                   help="the server's page size, for the oracle (default: --page-size)")


def build_workload(args: argparse.Namespace, vocab: int, seed: int) -> Workload:
    """The stream ``--workload`` names, drawn with ``seed``."""
    common = {"vocab_size": vocab, "seed": seed}
    if args.workload == "multi-turn":
        wl = multi_turn_workload(args.tenants, args.users, args.rounds,
                                 system_tokens=args.system_len, user_tokens=args.user_tokens,
                                 output_tokens=_fixed(args.output_len, "output-len"),
                                 turn_order=args.turn_order,
                                 preamble_tokens=args.preamble_len, **common)
    elif args.workload == "shared-prefix":
        wl = shared_prefix_workload(args.groups, args.prompts_per_group,
                                    system_len=args.system_len,
                                    question_len=parse_length(args.question_len, "question-len"),
                                    output_len=parse_length(args.output_len, "output-len"),
                                    tenants=args.tenants, **common)
    elif args.workload == "random":
        wl = random_workload(args.num_requests or 64,
                             input_len=parse_length(args.input_len, "input-len"),
                             output_len=parse_length(args.output_len, "output-len"),
                             tenants=args.tenants, **common)
    else:
        if not args.trace:
            raise ValueError("--trace: the trace workload needs a trace file")
        wl = trace_workload(args.trace, block_tokens=args.trace_block_tokens,
                            source_block=args.trace_source_block,
                            max_output_tokens=args.max_output_tokens,
                            time_scale=args.time_scale, tenants=args.tenants, **common)
    if args.num_requests is not None and args.workload != "random":
        wl = dataclasses.replace(wl, requests=wl.requests[:args.num_requests])
    return wl


def _fixed(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--{flag}: multi-turn takes a fixed count, got {text!r}") from None


def run(args: argparse.Namespace, after: Callable[[Any, Server], None] | None = None) -> int:
    """The command; ``after(cluster, server)`` (local target) runs once a cluster's runs are
    done, before it shuts down."""
    if args.action == "make-trace":
        out = args.trace or "trace.jsonl"
        lines = make_trace(out, num_requests=args.num_requests or 200, seed=args.seed)
        print(f"wrote {lines} requests to {out}")
        return 0
    local = args.target == "local"
    cfg = config_from_args(ClusterConfig, args) if local else None
    vocab = args.vocab_size or (cfg.pd_config.model.vocab_size if local else HTTP_VOCAB)
    workload = build_workload(args, vocab, args.seed)
    warm = build_workload(args, vocab, args.seed + 1)
    warmup = dataclasses.replace(warm, requests=warm.requests[:args.warmup_requests])
    load = Load(rates=tuple(parse_rates(args.request_rate)), arrival=args.arrival,
                burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                duration_s=args.duration, seed=args.seed, lockstep=args.lockstep)
    report = Report(output_dir=args.output_dir, per_run_dirs=args.compare_no_cache,
                    slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms),
                    page_size=args.page_size_hint or args.page_size,
                    lru_capacity_tokens=args.lru_capacity_tokens or
                    (_l3_tokens(cfg) if cfg else None),
                    plots=args.plots, progress=args.progress,
                    config=_describe(args, workload, cfg))
    print(workload.describe(), flush=True)
    servers = run_local(cfg, args, workload, warmup, load, report, after) if local \
        else run_http(args, workload, warmup, load, report)
    summaries = [s for server in servers for s in server.summaries]
    comparison = compare_outputs(*servers) if len(servers) == 2 else None
    if len(summaries) > 1:
        write_sweep(summaries, args.output_dir, args.plots, comparison)
    leaked = sum(s["results"]["cache"]["isolation"]["cross_tenant_hit_tokens"] or 0
                 for s in summaries)
    differ = sum(row["mismatched"] for row in comparison or [])
    return 1 if leaked or differ else 0


def run_local(cfg: ClusterConfig, args: argparse.Namespace, workload: Workload,
              warmup: Workload, load: Load, report: Report,
              after: Callable[[Any, Server], None] | None = None) -> list[Server]:
    from pd_cache.app.session import ray_session
    from pd_cache.cluster.pd_cluster import PDCluster

    servers: list[Server] = []
    with ray_session(args.address, dashboard=args.dashboard,
                     metrics_interval_ms=1000) as session:
        for cache in (True, False) if args.compare_no_cache else (True,):
            config = dataclasses.replace(cfg, cache=cache)
            print(f"starting {config.num_prefill} prefill + {config.num_decode} decode + "
                  f"{config.num_storage if config.with_storage else 0} storage actors "
                  f"(model {config.model}, cache {'on' if cache else 'off'})", flush=True)
            cluster = PDCluster.start(config)
            try:
                metrics = session.metrics_url if args.server_metrics else None
                server = Server(LocalTarget(cluster), metrics_url=metrics,
                                flush=cluster.flush, label=cache,
                                export_interval_s=config.metrics_interval_s + 1.5)
                server.summaries = asyncio.run(bench(server, workload, warmup, load, report))
                servers.append(server)
                if after is not None:
                    after(cluster, server)
            finally:
                cluster.shutdown()
    return servers


def run_http(args: argparse.Namespace, workload: Workload, warmup: Workload, load: Load,
             report: Report) -> list[Server]:
    target = HTTPTarget(args.target, api_keys=args.api_key, model=args.model_name,
                        drop_route=args.drop_caches_route if args.drop_caches else None,
                        admin_key=args.admin_key, text_prompts=args.text_prompts)
    server = Server(target, metrics_url=args.metrics_url, label="server")

    async def go() -> list[dict[str, Any]]:
        try:
            return await bench(server, workload, warmup, load, report)
        finally:
            await target.close()
    server.summaries = asyncio.run(go())
    return [server]


def _l3_tokens(cfg: ClusterConfig) -> int | None:
    """The cluster's L3 capacity in tokens (what the LRU oracle holds)."""
    if not cfg.with_storage:
        return None
    return cfg.storage_capacity_bytes // cfg.pd_config.layout.page_nbytes * cfg.page_size


def _describe(args: argparse.Namespace, workload: Workload,
              cfg: ClusterConfig | None) -> dict[str, Any]:
    out = {"target": args.target, "workload": workload.describe(), "seed": args.seed,
           "arrival": args.arrival, "burstiness": args.burstiness,
           "max_concurrency": args.max_concurrency, "lockstep": args.lockstep,
           "compare_no_cache": args.compare_no_cache,
           "request_rates": [r if math.isfinite(r) else "inf"
                             for r in parse_rates(args.request_rate)]}
    if cfg is not None:
        out["cluster"] = dataclasses.asdict(cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-cache bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"pd-cache bench: {exc}", file=sys.stderr)
        return 2
