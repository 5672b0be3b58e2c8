"""``pd-cache bench`` end to end: against an in-process PDCluster on the session's Ray
cluster, against the OpenAI-compatible front over real HTTP, and the command itself in a
process of its own (its own Ray cluster, cache on vs off).

Independent facts audit the results: every answer equals ``reference_generate`` on the
prompt the bench sent, no request reports more cached tokens than the oracle's upper bound,
and the server's own counters (scraped from the Ray metrics port) sum to what the answers
said.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pd_cache import ClusterConfig, Model, PDCluster, Req, reference_generate
from pd_cache.app.bench.driver import Load, Report, Server, bench
from pd_cache.app.bench.records import read_lines
from pd_cache.app.bench.targets import HTTPTarget, LocalTarget
from pd_cache.app.bench.workloads import Workload, multi_turn_workload

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(model="tiny", page_size=PS, device_pages=24, host_pages=48,
                       num_prefill=2, num_decode=1, num_storage=2, metrics_interval_s=1.0)
VOCAB = CONFIG.pd_config.model.vocab_size


def chat(seed: int, tenants: int = 2) -> Workload:
    return multi_turn_workload(tenants, 2, 3, system_tokens=24, user_tokens=6,
                               output_tokens=4, vocab_size=VOCAB, seed=seed,
                               turn_order="random")


def check_against_reference(workload: Workload, answers: dict[int, list[int]]) -> None:
    """Every request answered, each answer the model's own greedy output for its prompt."""
    model = Model(CONFIG.pd_config.model)
    assert sorted(answers) == [r.index for r in workload.requests]
    for spec in workload.requests:
        prompt = spec.prompt_ids(answers)
        want = reference_generate(model, Req(rid="ref", input_ids=prompt,
                                             max_new_tokens=spec.max_tokens)).output_ids
        assert answers[spec.index] == want, spec.index


def check_cache_figures(summary: dict[str, Any], records: list[Any]) -> None:
    cache = summary["results"]["cache"]
    # NOTE: the oracle takes requests in the order they were sent; the server may prefill
    # two sent together in the other order (the later one's system prompt then serves the
    # earlier), which moves hits between them but adds none: the bound holds in sum, and
    # each request reuses at most its prompt's full pages before its last token.
    for rec in records:
        assert rec.cached_tokens <= (rec.prompt_tokens - 1) // PS * PS, rec
    assert sum(r.cached_tokens for r in records) \
        <= sum(r.expected_cached_tokens for r in records)
    assert cache["client"]["cached_tokens"] > 0
    # The server's counters, exported by the workers and shards themselves, agree with
    # what the answers said, tier by tier where the answers tell.
    by_tier = cache["server_delta"]["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == cache["client"]["cached_tokens"], (by_tier, cache)
    tiers = [r.tier_hits for r in records if r.tier_hits is not None]
    if tiers:
        assert by_tier == {t: sum(h[t] for h in tiers) for t in by_tier}
    assert summary["results"]["requests"]["failed"] == 0


def test_local_target_open_loop_matches_the_model_and_the_servers_counters(
        ray_cluster: Any, tmp_path: Path) -> None:
    workload, warmup = chat(seed=5), chat(seed=6)
    cluster = PDCluster.start(CONFIG)
    try:
        server = Server(LocalTarget(cluster), flush=cluster.flush, export_interval_s=2.5,
                        metrics_url=f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics")
        load = Load(rates=(40.0,), seed=3)
        report = Report(output_dir=tmp_path, page_size=PS, lru_capacity_tokens=64 * PS,
                        plots=False, progress=False, config={"target": "local"})
        [summary] = asyncio.run(bench(server, workload, warmup, load, report))
        for state in cluster.states():   # dropped after the run: nothing held, nothing leaked
            assert state.locks == 0
            assert not any(p.get("radix") for p in state.pool_usage.values()), state
    finally:
        cluster.shutdown()
    check_against_reference(workload, server.answers[40.0])
    records = read_lines(tmp_path / "requests.jsonl")
    assert len(records) == len(workload.requests) == summary["results"]["requests"]["total"]
    check_cache_figures(summary, records)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["schema_version"] == "pdcache.bench/1"
    assert written["results"]["cache"]["isolation"]["cross_tenant_hit_tokens"] == 0
    # Turns after the first reuse the history: their hit rate is above turn 0's.
    per_turn = {t["turn"]: t["hit_rate"] for t in written["results"]["per_turn"]}
    assert per_turn[2] > per_turn[0]
    oracle = written["results"]["cache"]["oracle"]
    assert oracle["lru_hit_rate"] <= oracle["ideal_hit_rate"]


def test_http_target_through_the_openai_front_with_tenant_keys(
        ray_cluster: Any, serve_url: str, tmp_path: Path) -> None:
    from tests.integration.serving import running_app

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-bench-a": "a", "sk-bench-b": "b",
                                "sk-bench-ops": {"tenant": "ops", "admin": True}}))
    args = {"model": "tiny", "page_size": PS, "num_prefill": 1, "num_decode": 1,
            "num_storage": 1, "device_pages": 64, "host_pages": 128, "cluster_name": None,
            "api_keys_file": str(keys), "metrics_interval_s": 1.0}
    workload, warmup = chat(seed=8), chat(seed=9)
    with running_app(serve_url, args, "pd-cache-bench") as url:
        target = HTTPTarget(url, api_keys=["sk-bench-a", "sk-bench-b"],
                            admin_key="sk-bench-ops")
        server = Server(target, export_interval_s=2.5,
                        metrics_url=f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics")

        async def go() -> list[dict[str, Any]]:
            try:
                return await bench(server, workload, warmup, Load(max_concurrency=3),
                                   Report(output_dir=tmp_path / "out", page_size=PS,
                                          plots=False, progress=False))
            finally:
                await target.close()
        [summary] = asyncio.run(go())
    check_against_reference(workload, server.answers[float("inf")])
    records = read_lines(tmp_path / "out" / "requests.jsonl")
    assert all(r.cached_tokens is not None for r in records)   # usage reports them
    assert all(r.tier_hits is None for r in records)   # per-tier details: admin keys only
    assert all(r.ttft_ms > 0 and len(r.itl_ms) == r.output_tokens - 1 for r in records)
    check_cache_figures(summary, records)


def test_the_command_compares_cache_on_and_off_on_the_same_arrivals(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "pd_cache.app.bench", "--model", "tiny", "--tenants", "2",
            "--users", "2", "--rounds", "2", "--system-len", "32", "--user-tokens", "8",
            "--output-len", "4", "--page-size", "4", "--num-prefill", "1", "--num-decode",
            "1", "--num-storage", "0", "--request-rate", "20", "--compare-no-cache",
            "--warmup-requests", "2", "--no-progress", "--no-server-metrics",
            "--output-dir", str(out)]   # the server's counters: the LocalTarget test above
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sweep = json.loads((out / "sweep.json").read_text())
    assert [row["mismatched"] for row in sweep["outputs_compared"]] == [0]
    assert sweep["outputs_compared"][0]["compared"] == 8
    on, off = (json.loads((out / f"cache-{m}-rate20" / "summary.json").read_text())
               for m in ("on", "off"))
    assert on["results"]["cache"]["client"]["cached_tokens"] > 0
    assert off["results"]["cache"]["client"]["cached_tokens"] == 0
    assert off["results"]["cache"]["oracle"]["ideal_hit_rate"] > 0   # the stream could reuse
    for mode in ("on", "off"):
        assert (out / f"cache-{mode}-rate20" / "ttft_cdf.png").stat().st_size > 0
    assert (out / "sweep.png").stat().st_size > 0
    assert "answers differ" in done.stdout


def test_a_decode_worker_killed_mid_run_costs_no_answer(ray_cluster: Any) -> None:
    """kill -9 of a decode worker while the bench streams: every stream on it resumes on
    the other worker (``PDCluster.stream``), every answer completes and is the model's own,
    and the cluster serves again on both."""
    import signal

    from pd_cache.app.bench.runner import run_open_loop

    workload = chat(seed=21, tenants=2)
    cluster = PDCluster.start(dataclasses.replace(CONFIG, num_decode=2))
    try:
        victim = ray.get(cluster.decode[0].pid.remote())
        killed: list[int] = []
        done: list[Any] = []

        def kill_after_three(record: Any) -> None:   # mid-run: 3 answered, the rest in flight
            done.append(record)
            if len(done) == 3:
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
        run = asyncio.run(run_open_loop(LocalTarget(cluster), workload.requests,
                                        [0.02 * i for i in range(len(workload.requests))],
                                        on_done=kill_after_three))
        assert killed == [victim]
        ok = [r for r in run.records if r.ok]
        assert len(ok) == len(workload.requests), [r.error for r in run.records if not r.ok]
        assert any(r.attempts == 2 for r in ok)   # some were on the killed worker
        model = Model(CONFIG.pd_config.model)
        for rec in ok:   # every answer that came back is the model's own
            spec = workload.requests[rec.index]
            want = reference_generate(model, Req(rid="ref", input_ids=run.prompts[rec.index],
                                                 max_new_tokens=spec.max_tokens)).output_ids
            assert run.answers[rec.index] == want, rec.index
        # The worker comes back (its actor restarts) and the cluster serves on both.
        deadline = time.monotonic() + 45
        while asyncio.run(cluster.health())["live"]["decode"] != [0, 1]:
            assert time.monotonic() < deadline, "the killed decode worker never came back"
            time.sleep(0.5)
        assert ray.get(cluster.decode[0].pid.remote()) != victim
        for worker in (0, 1):
            req = Req(rid=f"after-kill-{worker}", input_ids=list(range(40)), max_new_tokens=4)
            assert cluster.generate(req, decode_worker=worker).output_ids == \
                reference_generate(model, Req(rid="ref", input_ids=list(range(40)),
                                              max_new_tokens=4)).output_ids
    finally:
        cluster.shutdown(check=False)
