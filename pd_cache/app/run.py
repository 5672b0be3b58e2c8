"""``pd-cache run``: ``pd-cache bench``'s closed loop in lockstep, under the flags it has
always had, printing what the cache did.

Its cluster flags are ``ClusterConfig``'s fields (``pd_cache.app.flags``). Starts an embedded
local Ray cluster (or joins ``--address``), creates the prefill, decode and storage actors,
runs every conversation's turns round by round (all conversations of a round in flight at
once, the next round after the last answer: ``pd-cache bench --workload multi-turn
--request-rate inf --lockstep``) and prints the bench's table, then the cluster's own counts.
Every tenant has its own ``cache_salt``, odd tenants serve through a LoRA-like ``extra_key``
(``bench.workloads.tenant_namespace``), clients of a tenant share its system prompt, and all
prompts start with one platform preamble, so identical tokens exist in different
namespaces: ``cross-namespace hits`` must stay 0.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np

from pd_cache.app.bench import cli as bench_cli
from pd_cache.app.bench.driver import Server
from pd_cache.app.flags import add_config_arguments
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.wire import Completion, totals

PREAMBLE_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--dashboard", action="store_true", help="start the Ray dashboard")
    add_config_arguments(parser, ClusterConfig, "cluster")
    load = parser.add_argument_group("workload")
    load.add_argument("--tenants", type=int, default=4)
    load.add_argument("--clients", type=int, default=2, help="clients per tenant")
    load.add_argument("--rounds", type=int, default=3)
    load.add_argument("--system-tokens", type=int, default=512)
    load.add_argument("--user-tokens", type=int, default=128)
    load.add_argument("--output-tokens", type=int, default=16)
    load.add_argument("--seed", type=int, default=0)


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The ``pd-cache bench`` flags this run stands for: no warm-up, no files, no progress
    bar, no wait for the metrics port; the cluster flags as given."""
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    out = parser.parse_args([
        "--workload", "multi-turn", "--request-rate", "inf", "--lockstep",
        "--tenants", str(args.tenants), "--users", str(args.clients),
        "--rounds", str(args.rounds), "--system-len", str(args.system_tokens),
        "--user-tokens", str(args.user_tokens), "--output-len", str(args.output_tokens),
        "--preamble-len", str(PREAMBLE_TOKENS), "--seed", str(args.seed),
        "--warmup-requests", "0", "--no-plots", "--no-progress", "--no-server-metrics"])
    for f in dataclasses.fields(ClusterConfig):
        setattr(out, f.name, getattr(args, f.name))
    out.address, out.dashboard, out.output_dir = args.address, args.dashboard, None
    return out


def run(args: argparse.Namespace) -> int:
    tables: list[tuple[list[Completion], float, dict[str, int]]] = []

    def after(cluster: Any, server: Server) -> None:
        seconds = server.summaries[-1]["results"]["duration_s"]
        tables.append((list(server.target.completions.values()), seconds,
                       cluster.l3_writes()))

    code = bench_cli.run(bench_args(args), after=after)
    for table in tables:
        print_table(*table)
    return code


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _share(tokens: int, total: int) -> str:
    """A token count with its share of all prompt tokens: the hit rate of a tier."""
    return f"{tokens} ({tokens / total:.0%})" if total else f"{tokens}"


def print_table(done: list[Completion], seconds: float, writes: dict[str, int]) -> None:
    t = totals(done)
    ttft = [c.ttft_s for c in done]
    generated = sum(len(c.output_ids) for c in done)
    cached = t["cached_tokens"]
    rows = [
        ("requests", f"{t['requests']}"),
        ("TTFT p50 / p90", f"{percentile(ttft, 50) * 1e3:.1f} ms / "
                           f"{percentile(ttft, 90) * 1e3:.1f} ms"),
        ("tokens/s (generated)", f"{generated / seconds:.1f}" if seconds else "-"),
        *((f"cached tokens: {tier}", _share(cached[tier], t["prompt_tokens"]))
          for tier in ("device", "host", "storage")),
        ("prompt tokens computed", _share(t["prompt_tokens"] - sum(cached.values()),
                                          t["prompt_tokens"])),
        ("pages handed off", f"{t['pages_handed_off']}"),
        ("pages offloaded by decode", f"{writes['offload']}"),
        ("pages written through by prefill", f"{writes['backup']}"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"{key:<{width}}  {value:>18}")
    print(f"cross-namespace hits: {t['cross_namespace_tokens']}")
