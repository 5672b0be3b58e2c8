"""The floors of ``pd_cache/`` (docs/architecture.md, "The folders"): a folder imports only
folders on lower floors, never one on its own floor or above, not even inside a function or
under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "pd_cache"
FLOORS = {"core": 0, "kv": 1, "metrics": 1, "model": 2, "storage": 2, "tiering": 3,
          "worker": 4, "cluster": 5, "front": 6, "app": 7}


def folder(module: str) -> str | None:
    """The folder of ``pd_cache.<folder>...``; ``None`` for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pd_cache" else None


def imported(path: Path, pkg: Path) -> set[str]:
    """Every ``pd_cache`` module ``path`` imports, relative imports resolved."""
    package = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            out.add(".".join(p for p in (base, node.module or "") if p))
    return {m for m in out if m.split(".")[0] == "pd_cache"}


def arrows_up(pkg: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        here = path.relative_to(pkg).parts[0]
        if here not in FLOORS:
            continue  # pd_cache/__init__.py: the public API over every floor
        for module in sorted(imported(path, pkg)):
            there = folder(module)
            if there != here and (there is None or FLOORS[there] >= FLOORS[here]):
                bad.append(f"{path.relative_to(pkg)} imports {module}")
    return bad


def test_every_folder_has_a_floor() -> None:
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FLOORS)


def test_no_folder_imports_its_own_floor_or_above() -> None:
    assert arrows_up() == []


@pytest.mark.parametrize("source, expected", [
    ("from pd_cache.front.serve import app", ["kv/x.py imports pd_cache.front.serve"]),
    ("import pd_cache.metrics", ["kv/x.py imports pd_cache.metrics"]),
    ("from ..worker import engine", ["kv/x.py imports pd_cache.worker"]),
    ("from pd_cache.core.hashing import page_hashes\nfrom . import pool", []),
])
def test_an_arrow_up_is_found(tmp_path: Path, source: str, expected: list[str]) -> None:
    fake = tmp_path / "pd_cache"
    (fake / "kv").mkdir(parents=True)
    (fake / "kv" / "x.py").write_text(source)
    assert arrows_up(fake) == expected
