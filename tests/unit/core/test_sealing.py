"""The server secret: one check for every key derived from it, and its file."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_cache.core.sealing import Keyring, read_or_create_secret
from pd_cache.front.tenants import Tenants


@pytest.mark.parametrize("secret", [b"", bytes(15), "0" * 32, None])
def test_a_short_or_non_bytes_secret_is_refused_by_every_user_of_it(secret: object) -> None:
    with pytest.raises(ValueError, match="secret: expected at least 16 bytes"):
        Keyring(secret)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="secret: expected at least 16 bytes"):
        Tenants({}, secret)   # type: ignore[arg-type]


def test_the_secret_file_is_created_0600_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "keys.secret"
    secret = read_or_create_secret(path)
    assert len(secret) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert read_or_create_secret(path) == secret == bytes.fromhex(path.read_text())


@pytest.mark.parametrize("text", ["not hex", "00" * 15])
def test_a_bad_secret_file_names_itself_and_is_left_alone(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.secret"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"secret file {path}: expected at least 16 bytes"):
        read_or_create_secret(path)
    assert path.read_text() == text
