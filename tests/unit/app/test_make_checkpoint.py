"""``pd-cache make-checkpoint``: a missing extra or a bad shape says what to do and leaves
nothing behind; the shape flags reach the checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pd_cache.app.cli import main
from pd_cache.app.tiny_checkpoint import make_tiny_checkpoint


def test_without_the_hf_extra_it_says_what_to_install_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # transformers caches which packages it found on its first import: import it before
    # tokenizers is hidden, or every later test in this process sees no tokenizers either
    pytest.importorskip("transformers")
    monkeypatch.setitem(sys.modules, "tokenizers", None)   # import tokenizers: ImportError
    assert main(["make-checkpoint", str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "hf extra (tokenizers missing)" in err and "pip install -e '.[hf]'" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, flag", [
    (["--vocab-size", "100"], "--vocab-size"),
    (["--vocab-size", "5000"], "--vocab-size"),
    (["--layers", "0"], "--layers"),
    (["--max-context", "-1"], "--max-context"),
    (["--intermediate-size", "0"], "--intermediate-size"),
    (["--heads", "3"], "--hidden-size"),          # 64 does not split into 3 heads
    (["--hidden-size", "36", "--heads", "4"], "--hidden-size"),   # heads of 9: odd
])
def test_a_bad_shape_names_its_flag_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    pytest.importorskip("tokenizers")
    assert main(["make-checkpoint", str(tmp_path / "ckpt"), *argv]) == 2
    assert capsys.readouterr().err.startswith(f"pd-cache: {flag}:")
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_directory_is_refused_and_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "mine.txt").write_text("keep")
    assert main(["make-checkpoint", str(tmp_path / "ckpt")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.rglob("*")] == ["ckpt", "mine.txt"]


def test_a_failure_while_writing_leaves_nothing_behind(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(KeyError):   # transformers refuses the rope type mid-way
        make_tiny_checkpoint(str(tmp_path / "ckpt"), rope_scaling={"rope_type": "nope"})
    assert list(tmp_path.iterdir()) == []


def test_the_shape_flags_reach_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "ckpt").mkdir()   # an empty directory is used as it is
    assert main(["make-checkpoint", str(tmp_path / "ckpt"), "--max-context", "4096",
                 "--vocab-size", "300", "--hidden-size", "32", "--layers", "1",
                 "--intermediate-size", "48", "--heads", "2"]) == 0
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["vocab_size"], config["hidden_size"],
            config["num_hidden_layers"], config["intermediate_size"],
            config["num_attention_heads"]) == (4096, 300, 32, 1, 48, 2)
    tokenizer = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    assert tokenizer["model_max_length"] == 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
