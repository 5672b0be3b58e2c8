"""The ``pd-cache`` command."""

from __future__ import annotations

import argparse
import sys

from pd_cache.app import names, run, serve, tiny_checkpoint
from pd_cache.app.bench import cli as bench_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser(
        "run", help="run a multi-tenant workload through a PD cluster on Ray")
    run.add_arguments(run_parser)
    names_parser = sub.add_parser(
        "names", help="name a workload's pages and show reuse (no Ray)")
    names.add_arguments(names_parser)
    serve_parser = sub.add_parser(
        "serve", help="deploy a Ray Serve config (deployments/) over HTTP")
    serve.add_arguments(serve_parser)
    bench_parser = sub.add_parser(
        "bench", help="an open-loop load generator: local cluster or any OpenAI-compatible "
                      "server")
    bench_cli.add_arguments(bench_parser)
    make = sub.add_parser("make-checkpoint", help="write a tiny random Llama or Qwen2 "
                                                  "checkpoint to try --model DIR (hf extra)")
    tiny_checkpoint.add_arguments(make)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"run": run.run, "names": names.run, "serve": serve.run, "bench": bench_cli.run,
                "make-checkpoint": tiny_checkpoint.run}
    try:
        return commands[args.command](args)
    except ValueError as exc:
        print(f"pd-cache: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
