"""The ``pd-cache`` command."""

from __future__ import annotations

import argparse
import sys

from pd_cache import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the main job and print what happened")
    demo.add_arguments(run)
    args = parser.parse_args(argv)
    try:
        return demo.run(args)
    except ValueError as exc:
        print(f"pd-cache: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
