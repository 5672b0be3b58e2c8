from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random Llama and Qwen2 checkpoints (``tests/hf_checkpoints.py``), built once."""
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import build_all

    return build_all(str(tmp_path_factory.mktemp("checkpoints")))
