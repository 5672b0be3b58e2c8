"""``pd-cache serve``: open mode only on loopback; ``--api-keys`` reaches every app; the
cluster's flags override the pd-cache app's args; a Serve actor dying at start is explained;
the config's logging (no access log) reaches Serve."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import pytest

from pd_cache.app import serve as serve_cli
from pd_cache.app.cli import build_parser
from pd_cache.app.flags import given_fields
from pd_cache.app.serve import load_serve_config, with_api_keys, with_cluster_flags
from pd_cache.core.cluster_config import ClusterConfig
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


# -- the cluster's flags, --dashboard, a start that fails ---------------------------------
def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", str(CONFIG), *argv])


def test_cluster_flags_override_the_pd_cache_apps_args() -> None:
    args = _serve_args("--model", "tiny", "--num-prefill", "1", "--no-cache",
                       "--storage-backend", "disk", "--disk-path", "/var/l3")
    config = with_cluster_flags(load_serve_config(CONFIG), given_fields(ClusterConfig, args))
    (entry,) = config.applications
    cluster = AppArgs.parse(entry.args).cluster
    assert (cluster.model, cluster.num_prefill, cluster.cache, cluster.storage_backend,
            cluster.disk_path) == ("tiny", 1, False, "disk", "/var/l3")
    assert (cluster.page_size, cluster.num_decode, cluster.prefetch_policy) == \
        (16, 2, "best_effort")   # the config's own values where no flag is given


def test_without_cluster_flags_the_config_is_unchanged() -> None:
    config = with_cluster_flags(load_serve_config(CONFIG),
                                given_fields(ClusterConfig, _serve_args()))
    assert config.applications[0].args == load_serve_config(CONFIG).applications[0].args


def test_a_bad_cluster_flag_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--model", "huge")
    assert "--model" in capsys.readouterr().err


def test_cluster_flags_need_a_pd_cache_app(tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text(CONFIG.read_text().replace("pd_cache.front.serve:app", "mine:app"))
    args = _serve_args("--model", "tiny")
    with pytest.raises(ValueError, match="--model: the config has no pd-cache application"):
        with_cluster_flags(load_serve_config(other), given_fields(ClusterConfig, args))


@pytest.mark.parametrize("command", [["serve", str(CONFIG)], ["bench"]])
def test_dashboard_is_accepted(command: list[str]) -> None:
    assert build_parser().parse_args([*command, "--dashboard"]).dashboard is True


def test_a_serve_actor_dying_at_start_is_explained(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from ray import serve as ray_serve
    from ray.exceptions import ActorDiedError

    def proxy_died(**_: Any) -> None:
        raise ActorDiedError()

    monkeypatch.setattr(serve_cli, "ray_session", lambda *_, **__: contextlib.nullcontext())
    monkeypatch.setattr(ray_serve, "start", proxy_died)
    monkeypatch.setattr(ray_serve, "shutdown", lambda: None)
    assert serve_cli.run(_serve_args("--model", "tiny")) == 1
    err = capsys.readouterr().err
    assert "a Ray Serve actor died while the applications started (ActorDiedError: " in err
    assert "--num-prefill 1" in err and "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S" in err


def test_the_configs_logging_reaches_serve_and_turns_the_access_log_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray import serve as ray_serve

    calls: dict[str, Any] = {}

    def run(app: Any, **kwargs: Any) -> None:
        calls["run"] = kwargs
        raise KeyboardInterrupt   # stop before serving

    monkeypatch.setattr(serve_cli, "ray_session", lambda *_, **__: contextlib.nullcontext())
    monkeypatch.setattr(ray_serve, "start", lambda **kwargs: calls.setdefault("start", kwargs))
    monkeypatch.setattr(ray_serve, "run", run)
    monkeypatch.setattr(ray_serve, "shutdown", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        serve_cli.run(_serve_args("--model", "tiny"))
    assert calls["start"]["logging_config"].enable_access_log is False     # proxy, controller
    assert calls["run"]["logging_config"].enable_access_log is False       # the app's replicas


def test_serve_knobs_join_the_job_env_unless_the_environment_or_the_config_sets_them(
) -> None:
    config = load_serve_config(CONFIG)
    env = serve_cli.job_runtime_env(config, {})["env_vars"]
    assert {k: env[k] for k in serve_cli.SERVE_KNOBS} == serve_cli.SERVE_KNOBS
    assert env["OMP_NUM_THREADS"] == "1"                                  # the config's own
    knob = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
    assert knob not in serve_cli.job_runtime_env(config, {knob: "1"})["env_vars"]
    config.applications[0].runtime_env["env_vars"][knob] = "1"
    assert serve_cli.job_runtime_env(config, {})["env_vars"][knob] == "1"
