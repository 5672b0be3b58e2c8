"""``pd-cache serve``: open mode only on loopback; ``--api-keys`` reaches every app."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_cache.app.serve import load_serve_config, with_api_keys
from pd_cache.front.app_args import AppArgs

CONFIG = Path(__file__).resolve().parents[3] / "deployments" / "serve_config.yaml"


def test_open_mode_refuses_a_non_loopback_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PD_CACHE_API_KEYS_FILE", raising=False)
    for host in ("127.0.0.1", "localhost", "::1"):
        with_api_keys(load_serve_config(CONFIG), None, host)
    for host in ("0.0.0.0", "192.0.2.7", "example.org"):
        with pytest.raises(ValueError, match="open mode"):
            with_api_keys(load_serve_config(CONFIG), None, host)


def test_api_keys_reach_every_app(tmp_path: Path) -> None:
    config = with_api_keys(load_serve_config(CONFIG), str(tmp_path / "keys.json"), "0.0.0.0")
    for entry in config.applications:
        assert AppArgs.parse(entry.args).ingress.api_keys_file == str(tmp_path / "keys.json")
