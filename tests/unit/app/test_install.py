"""What ``make run`` installs is what it needs: its plots come from the plots extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _recipe(target: str) -> str:
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert match, target
    return match.group(1)


def test_make_run_installs_what_its_plots_need() -> None:
    assert re.search(r"^run: \$\(VENV\)/\.installed\b", (ROOT / "Makefile").read_text(), re.M)
    extras = re.search(r"install --quiet -e '\.\[([\w,]+)\]'", _recipe("$(VENV)/.installed"))
    assert extras, "make run installs no extra"
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    needs = {re.split(r"[<>=!~\[ ]", dep)[0] for extra in extras.group(1).split(",")
             for dep in optional[extra]}
    assert "matplotlib" in needs
