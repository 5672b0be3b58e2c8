"""The test suite's own layout: no module of ``tests/`` imports a test module (``test_*.py``).

What test modules share lives in helper modules (``tests/unit/tiering/fakes.py``,
``tests/integration/clusters.py``, ...) or in conftest fixtures, so that each test module
runs alone, a test is collected only where it is written, and moving one test module
breaks no other. Imports are read with ``ast``: absolute, relative, and a test module
imported by name from its package all count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported(tree: ast.Module, package: str) -> Iterator[str]:
    """Every dotted name an import in ``tree`` may load; ``package`` resolves relative ones.
    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def imports_of_test_modules(tests: Path) -> list[str]:
    """``"importer -> imported"`` for each import of a test module by a module of ``tests``
    (the folder of the package named ``tests``)."""
    root = tests.parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        package = ".".join(path.parent.relative_to(root).parts)
        for name in imported(ast.parse(path.read_text(), str(path)), package):
            target = root.joinpath(*name.split(".")).with_suffix(".py")
            if target.name.startswith("test_") and target.is_file():
                found.append(f"{path.relative_to(root)} -> {name}")
    return sorted(set(found))


def test_no_module_of_the_suite_imports_a_test_module() -> None:
    assert imports_of_test_modules(TESTS) == []


def test_the_check_finds_absolute_relative_and_by_name_imports(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit" / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "unit/__init__.py": "",
        "unit/sub/__init__.py": "",
        "unit/fakes.py": "def shared() -> int:\n    return 1\n",
        "unit/test_a.py": "def test_a() -> None:\n    pass\n",
        "unit/test_ok.py": ("from tests.unit.fakes import shared\n"
                            "from . import fakes\nimport tests.unit.fakes\n"),
        "unit/test_absolute.py": "from tests.unit.test_a import test_a\n",
        "unit/test_plain.py": "import tests.unit.test_a\n",
        "unit/test_by_name.py": "from tests.unit import test_a\n",
        "unit/sub/test_relative.py": "def f() -> None:\n    from ..test_a import test_a\n",
        "unit/helper.py": "from .test_a import test_a\n",
    }
    for name, text in files.items():
        (tests / name).write_text(text)
    assert imports_of_test_modules(tests) == [
        "tests/unit/helper.py -> tests.unit.test_a",
        "tests/unit/sub/test_relative.py -> tests.unit.test_a",
        "tests/unit/test_absolute.py -> tests.unit.test_a",
        "tests/unit/test_by_name.py -> tests.unit.test_a",
        "tests/unit/test_plain.py -> tests.unit.test_a",
    ]
