"""The tail every benchmark shares: its result written as JSON, then said.

A result is indented JSON with a trailing newline, its folder made if need be (by default
``benchmarks/results``). ``show`` is what the script prints once it is written::

    "path"   wrote benchmarks/results/evict.json     (the path as the script names it)
    "name"   wrote engine.json
    "json"   the JSON itself
    None     nothing (the script's own summary line says it, or nothing is said)

Scripts import it as ``from results_io import write_result`` (this folder is on the path
of a script run from it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

Show = Literal["path", "name", "json"] | None


def write_result(path: Path, result: Mapping[str, Any], show: Show = "path") -> Path:
    """Write ``result`` to ``path`` and print what ``show`` asks; ``path``."""
    if show not in ("path", "name", "json", None):
        raise ValueError(f"show: expected 'path', 'name', 'json' or None, got {show!r}")
    text = json.dumps(result, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    if show == "json":
        print(text)
    elif show is not None:
        print(f"wrote {path if show == 'path' else path.name}")
    return path
