"""``pd-cache run`` is ``pd-cache bench``'s closed loop in lockstep under its own flags, and
``pd-cache names`` names the bench's multi-turn workload (no Ray: parsing and workloads)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from pd_cache.app import names, run
from pd_cache.app.bench import cli as bench_cli
from pd_cache.app.bench.arrivals import parse_rates
from pd_cache.app.bench.workloads import tenant_namespace

ARGV = ["--tenants", "3", "--clients", "2", "--rounds", "4", "--system-tokens", "40",
        "--user-tokens", "9", "--output-tokens", "5", "--seed", "7", "--model", "tiny",
        "--num-prefill", "1", "--no-cache", "--address", "auto", "--dashboard"]


def parse(command: Any, argv: list[str]) -> argparse.Namespace:
    """``argv`` as the module ``command`` of ``pd-cache`` reads it."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_stands_for_the_bench_closed_loop_in_lockstep() -> None:
    args = run.bench_args(parse(run, ARGV))
    assert (args.action, args.target, args.workload) == ("run", "local", "multi-turn")
    assert args.lockstep and [math.isinf(r) for r in parse_rates(args.request_rate)] == [True]
    assert (args.tenants, args.users, args.rounds) == (3, 2, 4)
    assert (args.system_len, args.user_tokens, args.output_len) == (40, 9, "5")
    assert (args.preamble_len, args.seed, args.warmup_requests) == (run.PREAMBLE_TOKENS, 7, 0)
    assert args.output_dir is None and not (args.plots or args.progress or args.server_metrics)
    # the cluster flags as given (not the bench's own defaults)
    assert (args.model, args.num_prefill, args.cache) == ("tiny", 1, False)
    assert args.metrics_interval_s == parse(run, []).metrics_interval_s
    assert (args.address, args.dashboard) == ("auto", True)


def test_run_workload_is_every_client_every_round_behind_one_shared_preamble() -> None:
    args = run.bench_args(parse(run, ARGV))
    w = bench_cli.build_workload(args, vocab=256, seed=args.seed)
    assert len(w.requests) == 3 * 2 * 4
    assert {r.turn for r in w.requests} == {0, 1, 2, 3}
    prompts = [r.prompt_ids({i: [1] * 5 for i in range(len(w.requests))}) for r in w.requests]
    assert len({tuple(p[:run.PREAMBLE_TOKENS]) for p in prompts}) == 1
    for r in w.requests:
        assert (r.cache_salt, r.extra_key) == tenant_namespace(r.tenant)


@pytest.mark.parametrize("flag", ["--lockstep", "--preamble-len"])
def test_the_bench_offers_the_closed_loop_flags(flag: str) -> None:
    argv = [flag] if flag == "--lockstep" else [flag, "12"]
    args = parse(bench_cli, argv)
    assert args.lockstep == (flag == "--lockstep")
    assert args.preamble_len == (12 if flag == "--preamble-len" else 0)


def test_names_shares_no_page_name_across_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    assert names.run(parse(names, ["--tenants", "3", "--clients", "2", "--rounds", "2"])) == 0
    out = capsys.readouterr().out
    assert "12 requests" in out
    assert "cross-namespace shared names: 0" in out
    assert "reusable within a namespace: 0 pages" not in out
