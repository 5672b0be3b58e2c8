"""The ``pd-cache`` command."""

from __future__ import annotations

import argparse
import sys

from pd_cache import demo, job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a multi-tenant workload through a PD cluster on Ray")
    job.add_arguments(run)
    names = sub.add_parser("names", help="name a workload's pages and show reuse (no Ray)")
    demo.add_names_arguments(names)
    args = parser.parse_args(argv)
    try:
        return job.run(args) if args.command == "run" else demo.run_names(args)
    except ValueError as exc:
        print(f"pd-cache: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
