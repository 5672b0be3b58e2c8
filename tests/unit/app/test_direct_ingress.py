"""``pd-cache serve --direct-ingress``: the job env pins Serve's replica port range to
``--port`` and moves Serve's proxy off it; asked for (the flag or the env var) with more
than one ingress replica (or application), refused before any Ray process starts; not
asked for, on only for a local cluster and one ingress replica."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pd_cache.app import direct_ingress
from pd_cache.app import serve as serve_cli
from pd_cache.app.cli import build_parser

CONFIG = Path(__file__).resolve().parents[3] / "deployments" / "serve_config.yaml"


def _start_only(monkeypatch: pytest.MonkeyPatch, *argv: str,
                config: Path = CONFIG) -> dict[str, Any]:
    """What ``pd-cache serve`` hands Ray: the job's runtime_env and Serve's http_options
    (stopped at the first ``serve.run``, before any app)."""
    from ray import serve as ray_serve

    calls: dict[str, Any] = {}

    @contextlib.contextmanager
    def session(*_: Any, runtime_env: dict[str, Any], **__: Any) -> Any:
        calls["runtime_env"] = runtime_env
        yield

    def run(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cli, "ray_session", session)
    monkeypatch.setattr(ray_serve, "start", lambda **kwargs: calls.setdefault("start", kwargs))
    monkeypatch.setattr(ray_serve, "run", run)
    monkeypatch.setattr(ray_serve, "shutdown", lambda: None)
    monkeypatch.setattr(ray_serve, "delete", lambda _: None)                 # --address
    monkeypatch.setattr(serve_cli, "_destroy_named_clusters", lambda _: None)
    args = build_parser().parse_args(["serve", str(config), "--model", "tiny", *argv])
    with pytest.raises(KeyboardInterrupt):
        serve_cli.run(args)
    return calls


def test_direct_ingress_pins_the_replica_to_the_port_and_moves_the_proxy_off_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(direct_ingress.ENABLE, raising=False)
    calls = _start_only(monkeypatch, "--direct-ingress", "--port", "18123")
    env, http = calls["runtime_env"]["env_vars"], calls["start"]["http_options"]
    assert (env[direct_ingress.ENABLE], env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("1", "18123", "18124")
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert http["host"] == "127.0.0.1" and http["port"] != 18123       # the proxy: elsewhere
    assert env["OMP_NUM_THREADS"] == "1"                                # the config's env kept
    # --no-direct-ingress, or the environment's switch off: Serve's proxy on the port
    for argv, environ in ((("--no-direct-ingress",), "1"), ((), "0")):
        monkeypatch.setenv(direct_ingress.ENABLE, environ)
        calls = _start_only(monkeypatch, *argv, "--port", "18123")
        assert calls["runtime_env"]["env_vars"][direct_ingress.ENABLE] == "0"
        assert calls["start"]["http_options"]["port"] == 18123
    # asked for by neither: on for a local cluster and one ingress replica
    monkeypatch.delenv(direct_ingress.ENABLE)
    calls = _start_only(monkeypatch, "--port", "18123")
    assert calls["runtime_env"]["env_vars"]["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "18123"


def test_not_asked_for_it_is_off_on_a_joined_cluster_or_with_two_ingress_replicas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(direct_ingress.ENABLE, raising=False)
    calls = _start_only(monkeypatch, "--address", "127.0.0.1:6379", "--port", "18123")
    assert calls["runtime_env"]["env_vars"][direct_ingress.ENABLE] == "0"
    calls = _start_only(monkeypatch, "--port", "18123", config=_two_replicas(tmp_path))
    assert calls["runtime_env"]["env_vars"][direct_ingress.ENABLE] == "0"
    assert calls["start"]["http_options"]["port"] == 18123


def _two_replicas(tmp_path: Path) -> Path:
    raw = yaml.safe_load(CONFIG.read_text())
    raw["applications"][0]["args"]["ingress_replicas"] = 2
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(raw))
    return two


def test_more_than_one_ingress_replica_is_refused_before_ray_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ray(*_: Any, **__: Any) -> None:
        raise AssertionError("a Ray session started")

    monkeypatch.setattr(serve_cli, "ray_session", no_ray)
    two = _two_replicas(tmp_path)
    for argv, environ in ((["--direct-ingress"], "0"), ([], "1")):   # the flag or the env
        monkeypatch.setenv(direct_ingress.ENABLE, environ)
        with pytest.raises(ValueError, match="ingress_replicas: 2; the replica listens on "
                                             "--port"):
            serve_cli.run(build_parser().parse_args(["serve", str(two), *argv]))
    raw = yaml.safe_load(two.read_text())
    raw["applications"][0]["args"]["ingress_replicas"] = 1
    raw["applications"].append({**raw["applications"][0], "name": "other",
                                "route_prefix": "/other"})
    two.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="2 applications; one port serves one replica"):
        serve_cli.run(build_parser().parse_args(["serve", str(two), "--direct-ingress"]))
