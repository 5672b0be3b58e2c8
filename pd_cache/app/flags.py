"""Command-line flags derived from a config dataclass: names, types, defaults and help
come from its fields, so a knob is written once (``ClusterConfig``) and offered everywhere.

    num_prefill: int = 2        ->  --num-prefill N      (int, default 2)
    cache: bool = True          ->  --cache / --no-cache
    disk_path: str | None       ->  --disk-path TEXT     (default: none)
    storage_backend (choices)   ->  --storage-backend {disk,memory}
    model (check=...)           ->  --model TEXT         (the field's check refuses bad text)
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from pd_cache.core.fields import help_of, read_text

T = TypeVar("T")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type,
                         group: str | None = None, *, overrides: bool = False) -> None:
    """One flag per field of the dataclass ``cls``. ``overrides``: a flag has no default and
    only the flags given reach the namespace (``given_fields`` reads them), for values that
    override another source's (a Serve config's ``args``)."""
    target: Any = parser.add_argument_group(group) if group else parser
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        default = argparse.SUPPRESS if overrides else f.default
        text = help_of(f) + (" (default: the config's value)" if overrides
                             else " (default: %(default)s)")
        if kind == "bool":
            target.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=text)
            continue
        choices = f.metadata.get("choices")
        target.add_argument(flag, dest=f.name, default=default,
                            metavar=None if choices else _metavar(kind),
                            type=_reader(flag, kind, f.metadata.get("check")),
                            choices=choices, help=text)


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The dataclass ``cls`` from the parsed flags ``add_config_arguments`` added."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**values)


def given_fields(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (flags added with ``overrides``)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if hasattr(args, f.name)}


def _reader(flag: str, kind: str, check: Any = None) -> Any:
    """Reads a flag's text as ``kind``; ``check(flag, value)``, a field's own check
    (``metadata={"check": ...}``), may refuse the value with a ``ValueError``."""
    base = kind.replace(" | None", "")

    def read(text: str) -> Any:
        try:
            value = read_text(flag, text, base)
            if check is not None:
                check(flag, value)
            return value
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return read


def _metavar(kind: str) -> str:
    return {"int": "N", "float": "X"}.get(kind.replace(" | None", ""), "TEXT")
