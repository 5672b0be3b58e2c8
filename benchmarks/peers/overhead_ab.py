"""The serving overhead of two commits side by side: ``pd-cache serve`` on the tiny
checkpoint, one request at a time, split by hop (``overhead.py``), old and new alternating.

    python benchmarks/peers/overhead_ab.py --old REV [--new REV] [--layout 1+1+1]
        [--also REV@LAYOUT[@KEY=VALUE,...] ...] [--repeats 3] [--requests 20]
        [--env KEY=VALUE ...]

Each repeat starts the server of each commit in turn (old, new, old, new, ...), so drifts
in a shared machine's load fall on both alike; each commit runs from a temporary git
worktree (``ab_commits.checkout``). The compute floor is measured once, in this process,
before any server starts. ``--layout`` is serve_config's (``serve_config``: 2 prefill + 2
decode + 2 L3 shards) or ``P+D+S`` workers. Medians of the repeats (each run's own figures
are medians of ``--requests`` requests) go under the layout's key in
``benchmarks/results/overhead.json`` (an entry it replaces moves to ``earlier``); the other
layouts' entries are kept. ``--also REV@LAYOUT`` adds a side: a commit (``new``, ``old`` or
any revision) on a layout, run in turn with the others (a third commit, or two layouts
compared in the same minutes), with environment variables of its own after a second ``@``
(a Serve knob on or off beside the same commit without it). ``--env`` sets an environment
variable for every side. Run it alone, under the shared Ray lock: it starts a Ray cluster
per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import checkpoints  # noqa: E402
import overhead  # noqa: E402
from ab_commits import checkout  # noqa: E402
from servers import PdCache  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "overhead.json"
PD_FLAGS = ["--page-size", "16", "--device-pages", "256", "--host-pages", "256"]
TOKENS = 256


def layout_flags(layout: str) -> list[str]:
    """``serve_config`` -> no flags; ``P+D+S`` -> the worker counts."""
    if layout == "serve_config":
        return []
    p, d, s = (int(x) for x in layout.split("+"))
    return ["--num-prefill", str(p), "--num-decode", str(d), "--num-storage", str(s)]


def short(rev: str) -> str:
    """``rev``'s abbreviated commit hash (what a result records: HEAD moves)."""
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def run_one(tree: Path, work: Path, model_dir: str, flags: list[str], env: dict[str, str],
            requests: int, floor: float) -> dict[str, Any]:
    """One server from ``tree``: started, measured, stopped."""
    server = PdCache(work, model_dir, PD_FLAGS + flags, tree=tree, env=env)
    server.start()
    try:
        stamps = overhead.hops(server.url, server.model, TOKENS, requests)
    finally:
        server.stop()
    return overhead.breakdown(stamps, floor)


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median over runs of the overhead, the TTFT and every hop."""
    out = {k: statistics.median(r[k] for r in runs)
           for k in ("serving_overhead_ms", "ttft_p50_ms", "hops_outside_worker_p50_ms")}
    for hop in runs[0]["hops_p50_ms"]:
        out[hop] = statistics.median(r["hops_p50_ms"][hop] for r in runs)
    return {k: round(v, 2) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the commit before the change")
    ap.add_argument("--new", default="HEAD", help="the commit after it (default HEAD)")
    ap.add_argument("--layout", default="serve_config", help="serve_config or P+D+S")
    ap.add_argument("--also", action="append", default=[], metavar="REV@LAYOUT[@K=V,...]",
                    help="another side: REV (new, old or a commit) on LAYOUT, with the "
                         "environment variables K=V")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20, help="requests a run")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--work-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "pd-cache-peers")
    ap.add_argument("--output", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.env)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = checkpoints.build("tiny", str(args.work_dir / "checkpoints"))
    floor = overhead.floor_ms(model_dir, TOKENS)
    scratch = Path(tempfile.mkdtemp(prefix="pd-cache-overhead-"))
    trees: dict[str, Path] = {}
    revs = {"old": short(args.old), "new": short(args.new)}   # HEAD may move meanwhile
    sides = {"old": ("old", args.layout, {}), "new": ("new", args.layout, {})}
    for also in args.also:
        rev, layout, *extra = also.split("@", 2)
        if rev not in revs:
            revs[rev] = short(rev)
        sides[also] = (rev, layout, dict(kv.split("=", 1) for kv in
                                         (extra[0].split(",") if extra else [])))
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    load = [os.getloadavg()[0]]
    try:
        for side, rev in revs.items():
            trees[side] = checkout(rev, scratch / side)
        for i in range(args.repeats):
            for side, (tree, layout, own) in sides.items():
                run = run_one(trees[tree], args.work_dir, model_dir, layout_flags(layout),
                              {**env, **own}, args.requests, floor["min_ms"])
                runs[side].append(run)
                print(f"{layout} run {i + 1}/{args.repeats} {side}: overhead "
                      f"{run['serving_overhead_ms']} ms, hops {run['hops_p50_ms']}", flush=True)
        load.append(os.getloadavg()[0])
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(tree)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    entry = {**revs, "sides": sides, "repeats": args.repeats,
             "requests": args.requests, "prompt_tokens": TOKENS, "env": env, "floor": floor,
             "load_avg_1m": [round(x, 2) for x in load],
             "median": {side: medians(r) for side, r in runs.items()}, "runs": runs}
    result = json.loads(args.output.read_text()) if args.output.exists() else {}
    if args.layout in result:
        result.setdefault("earlier", []).append({"layout": args.layout,
                                                 **result[args.layout]})
    result[args.layout] = entry
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for side in sides:
        print(f"{side}: {entry['median'][side]}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
