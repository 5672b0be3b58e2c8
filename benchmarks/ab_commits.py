"""Run benchmarks on two commits, interleaved (old, new, old, new, ...), and compare.

A restructure that should not change behaviour is checked this way: each benchmark runs
``--repeats`` times on each commit, alternating, so slow drifts in a shared machine's load
fall on both sides alike. Each commit is checked out into a temporary git worktree and run
with this checkout's Python and that worktree first on ``PYTHONPATH``; the figures are read
from the JSON each benchmark writes. Prints, per figure, every run, the medians and whether
the new median lies within the old runs' spread; writes ``benchmarks/results/ab.json``
(``--out``: another name there).

    python benchmarks/ab_commits.py --old REV --new REV [--repeats 3] [--out ab.json]

Not a ``bench_*.py``: ``make bench`` does not run it.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# benchmark script -> (its JSON under benchmarks/results, the figures compared; a dotted
# figure is a path into the JSON: "on.cpu_seconds.decode")
BENCHMARKS = {
    "bench_pd.py": ("pd.json", ("throughput_ratio", "ttft_p50_ratio", "efficiency",
                                "efficiency_strict", "on.seconds", "on.cpu_seconds.prefill",
                                "on.cpu_seconds.decode", "on.page_faults.prefill",
                                "on.page_faults.decode", "off.seconds",
                                "off.cpu_seconds.prefill")),
    "bench_engine.py": ("engine.json", ("ttft_vs_floor", "paired_device_hit_ttft_vs_floor",
                                        "paired_host_hit_ttft_vs_floor",
                                        "median_cold_ttft_s")),
}


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` with this checkout's compiled C loops (the hash chain,
    decode's attention), each where ``rev`` has its source."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(into),
                    rev], check=True)
    for built in (ROOT / "pd_cache").glob("*/_*.so"):
        place = into / built.relative_to(ROOT)
        if place.with_name(built.name.split(".")[0] + ".c").exists():
            shutil.copy2(built, place)
    return into


def _commit(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def run_once(tree: Path, script: str) -> dict[str, float]:
    json_name, keys = BENCHMARKS[script]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "benchmarks" / script)], cwd=tree, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    result = json.loads((tree / "benchmarks" / "results" / json_name).read_text())
    return {key: float(functools.reduce(operator.getitem, key.split("."), result))
            for key in keys}


def compare(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for key in runs["old"][0]:
        old = [r[key] for r in runs["old"]]
        new = [r[key] for r in runs["new"]]
        median_new = statistics.median(new)
        out[key] = {"old": old, "new": new, "median_old": statistics.median(old),
                    "median_new": median_new,
                    "within_old_spread": min(old) <= median_new <= max(old)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the commit before the change")
    parser.add_argument("--new", default="HEAD", help="the commit after it (default HEAD)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bench", action="append", choices=sorted(BENCHMARKS),
                        help="which benchmarks (default: all of them)")
    parser.add_argument("--out", default="ab.json",
                        help="the result file's name under benchmarks/results (default "
                             "ab.json; name another to keep an earlier comparison)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="pd-cache-ab-"))
    trees: dict[str, Path] = {}
    try:
        for side, rev in (("old", args.old), ("new", args.new)):
            trees[side] = checkout(rev, scratch / side)
        # NOTE: the commits themselves, not "HEAD~1": the file must still say what ran later.
        report: dict[str, object] = {"old": _commit(args.old), "new": _commit(args.new),
                                     "repeats": args.repeats, "benchmarks": {}}
        for script in args.bench or sorted(BENCHMARKS):
            runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
            for i in range(args.repeats):
                for side in ("old", "new"):
                    print(f"{script} run {i + 1}/{args.repeats}: {side}", flush=True)
                    runs[side].append(run_once(trees[side], script))
            figures = compare(runs)
            report["benchmarks"][script] = figures  # type: ignore[index]
            for key, f in figures.items():
                print(f"  {key:34s} old {_fmt(f['old'])}  new {_fmt(f['new'])}  "
                      f"median {f['median_old']:.3f} -> {f['median_new']:.3f}  "
                      f"{'within' if f['within_old_spread'] else 'OUTSIDE'} old spread",
                      flush=True)
        out = ROOT / "benchmarks" / "results" / args.out
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _fmt(values: object) -> str:
    return "/".join(f"{v:.3f}" for v in values)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
