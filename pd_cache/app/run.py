"""``pd-cache run``: a multi-tenant, multi-turn workload through a PD cluster on Ray.

Its cluster flags are ``ClusterConfig``'s fields (``pd_cache.app.flags``). Starts an embedded
local Ray cluster (or joins ``--address``), creates the prefill, decode
and storage actors, runs every conversation's turns round by round (all conversations of a
round in flight at once) and prints what the cache did. Every tenant has its own
``cache_salt``, odd tenants serve through a LoRA-like ``extra_key``, clients of a tenant
share its system prompt, and all prompts start with one platform preamble, so identical
tokens exist in different namespaces: ``cross-namespace hits`` must stay 0.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np

from pd_cache.app.flags import add_config_arguments, config_from_args
from pd_cache.app.session import ray_session
from pd_cache.app.workload import Conversation, WorkloadConfig, make_conversations
from pd_cache.cluster.pd_cluster import PDCluster, totals
from pd_cache.core.cluster_config import ClusterConfig, model_config
from pd_cache.core.request import Req
from pd_cache.core.wire import Completion

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


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(tenants=args.tenants, clients_per_tenant=args.clients,
                          system_tokens=args.system_tokens, rounds=args.rounds,
                          user_tokens=args.user_tokens, output_tokens=args.output_tokens,
                          vocab_size=model_config(args.model).vocab_size, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    cfg, wl = config_from_args(ClusterConfig, args), workload_config(args)
    with ray_session(args.address, dashboard=args.dashboard):
        print(f"starting {cfg.num_prefill} prefill + {cfg.num_decode} decode + "
              f"{cfg.num_storage if cfg.with_storage else 0} storage actors "
              f"(model {cfg.model})", flush=True)
        cluster = PDCluster.start(cfg)
        try:
            start = time.perf_counter()
            done = run_workload(cluster, wl, progress=print)
            seconds = time.perf_counter() - start
            cluster.flush()
            writes = cluster.l3_writes()
        finally:
            cluster.shutdown()
    print_table(done, seconds, writes)
    return 0 if totals(done)["cross_namespace_tokens"] == 0 else 1


def run_workload(cluster: PDCluster, wl: WorkloadConfig, *, progress: Any = None,
                 lockstep: bool = True) -> list[Completion]:
    """Every conversation's turns; returns every completion, round by round.

    ``lockstep``: round by round, all conversations of a round in flight at once, the next
    round once every answer of this one is in. Otherwise each client sends its next turn as
    soon as its own answer is in (SGLang's multi-turn benchmark: clients do not wait for
    one another), all clients at once.
    """
    convs, preamble = make_conversations(wl), preamble_tokens(wl)
    if not lockstep:
        per_client = asyncio.run(_clients_at_their_own_pace(cluster, wl, convs, preamble))
        return [outs[r] for r in range(wl.rounds) for outs in per_client]
    answers: dict[str, list[list[int]]] = {c.name: [] for c in convs}
    done: list[Completion] = []
    for r in range(wl.rounds):
        start = time.perf_counter()
        reqs = [turn_request(c, r, preamble, answers[c.name], wl.output_tokens) for c in convs]
        outs = cluster.generate_many(reqs)
        for c, out in zip(convs, outs):
            answers[c.name].append(out.output_ids)
        done += outs
        if progress is not None:
            prompt = sum(len(q.input_ids) for q in reqs)
            cached = sum(sum(o.cached_tokens.values()) for o in outs)
            progress(f"round {r + 1}/{wl.rounds}: {len(outs)} requests in "
                     f"{time.perf_counter() - start:.2f} s, {cached}/{prompt} prompt tokens "
                     f"cached", flush=True)
    return done


async def _clients_at_their_own_pace(cluster: PDCluster, wl: WorkloadConfig,
                                     convs: list[Conversation], preamble: list[int]
                                     ) -> list[list[Completion]]:
    """Every client at once, each sending its next turn when its own answer is in."""
    async def client(conv: Conversation) -> list[Completion]:
        answers: list[list[int]] = []
        outs = []
        for r in range(wl.rounds):
            out = await cluster.generate_async(
                turn_request(conv, r, preamble, answers, wl.output_tokens))
            answers.append(out.output_ids)
            outs.append(out)
        return outs

    return list(await asyncio.gather(*(client(c) for c in convs)))


def preamble_tokens(wl: WorkloadConfig) -> list[int]:
    """The platform preamble every prompt of ``wl`` starts with."""
    return np.random.default_rng(wl.seed + 1).integers(0, wl.vocab_size,
                                                       PREAMBLE_TOKENS).tolist()


def turn_request(conv: Conversation, r: int, preamble: list[int], answers: list[list[int]],
                 output_tokens: int) -> Req:
    """Round ``r`` of ``conv``, after its earlier ``answers``."""
    return Req(rid=f"{conv.name}/r{r}", input_ids=preamble + conv.prompt(r, answers),
               extra_key=conv.extra_key, cache_salt=conv.cache_salt,
               max_new_tokens=output_tokens)


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
