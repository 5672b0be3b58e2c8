"""A Ray cluster that pd-cache starts is its own: outsiders are refused, and it ends with
the command.

Ray's gRPC servers listen on every interface, so anyone who reaches the machine reaches
them; only the cluster's token (``pd_cache.app.session.cluster_token``) lets a process in.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from pd_cache.app.session import ClusterToken
from tests.integration.listening import http_listeners, listeners

ray = pytest.importorskip("ray")
import psutil  # noqa: E402  (the test extra)

ROOT = Path(__file__).resolve().parents[2]
OUTSIDER = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="WARNING")
print("joined:", ray.get(ray.remote(lambda: 42).remote()), flush=True)
"""
START_S, STOP_S = 90, 60


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Ray authentication or address, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return env | extra


def _join(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # NOTE: a refused driver retries the GCS once a second, 20 times by default.
    env = env | {"RAY_NUM_REDIS_GET_RETRIES": "3"}
    return subprocess.run([sys.executable, "-c", OUTSIDER, address], env=env, text=True,
                          capture_output=True, timeout=START_S)


def test_an_outsider_is_refused_and_the_token_lets_it_in(ray_cluster: Any,
                                                         ray_token: ClusterToken) -> None:
    address = "127.0.0.1:" + ray_cluster.address.rsplit(":", 1)[1]
    outsider = _join(address, _clean_env())
    assert outsider.returncode != 0 and "joined" not in outsider.stdout
    assert "AuthenticationError" in outsider.stderr, outsider.stderr[-2000:]
    insider = _join(address, _clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=ray_token.token))
    assert insider.returncode == 0, insider.stderr[-2000:]
    assert "joined: 42" in insider.stdout


def test_token_file_is_private(ray_token: ClusterToken) -> None:
    assert stat.S_IMODE(os.stat(ray_token.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(ray_token.path)).st_mode) == 0o700
    assert Path(ray_token.path).read_text() == ray_token.token


# -- stopping the command stops its cluster ----------------------------------------------------
def _serve_config(tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    for app in config["applications"]:
        app["args"].update(model="tiny", num_prefill=1, num_decode=1, num_storage=0)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_path(p: Any) -> str | None:
    try:
        return p.environ().get("RAY_AUTH_TOKEN_PATH")
    except (psutil.Error, OSError):
        return None


def _name(p: Any) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _cluster_of(command: subprocess.Popen[str]) -> tuple[str, set[Any]]:
    """The token file of the cluster ``command`` started, and every process that carries it
    (started by Ray, wherever it now hangs in the process tree) or descends from it."""
    family = psutil.Process(command.pid).children(recursive=True)
    path = next(filter(None, map(_token_path, family)))
    return path, set(family) | {p for p in psutil.process_iter() if _token_path(p) == path}


def _interruptible() -> None:
    """Ctrl-C reaches the command as at a terminal, even when this suite was started in the
    background of a shell (which ignores SIGINT, and ignored signals are inherited: Python
    then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(argv: list[str], home: Path, ready: str) -> tuple[subprocess.Popen[str], list[str]]:
    home.mkdir()
    command = subprocess.Popen([sys.executable, "-m", "pd_cache.app.cli", *argv], cwd=ROOT,
                               env=_clean_env(HOME=str(home)), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True, preexec_fn=_interruptible)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in command.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if ready in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_S
    while not seen.wait(0.5):
        if command.poll() is not None or time.monotonic() > deadline:
            _stop(command)
            pytest.fail(f"{ready!r} not printed in {START_S} s:\n{''.join(lines)[-3000:]}")
    return command, lines


def _stop(command: subprocess.Popen[str]) -> None:
    """End a command that failed the test: SIGTERM (so it cleans up), then SIGKILL."""
    if command.poll() is None:
        command.terminate()
        try:
            command.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(command.pid, signal.SIGKILL)


def _assert_http_on_loopback(output: str, pids: set[int], dashboard: bool) -> None:
    """The command printed its metrics URL (and the dashboard's, if it runs one), both on
    loopback and both answering; no process of its cluster serves HTTP beyond loopback."""
    found = http_listeners(pids)
    metrics = re.search(r"Ray metrics \(Prometheus text\): (http://127\.0\.0\.1:(\d+)\S*)",
                        output)
    assert metrics, output[-3000:]
    with urllib.request.urlopen(metrics.group(1), timeout=10) as r:
        assert b"ray_" in r.read()
    ports = {int(metrics.group(2))}
    if dashboard:
        url = re.search(r"Ray dashboard: http://127\.0\.0\.1:(\d+)", output)
        assert url, output[-3000:]
        ports.add(int(url.group(1)))
    assert ports <= {s.port for s in found}, found
    assert [s for s in found if not s.loopback] == []


def _assert_streams_on(port: int, output: str, cluster: set[Any]) -> None:
    """A streamed chat completion is answered on ``port``, the one URL the command printed,
    by the ingress replica itself: Serve's proxy listens elsewhere."""
    assert f"pd-cache: http://127.0.0.1:{port}/" in output, output[-3000:]
    (owner,) = {s.pid for s in listeners({p.pid for p in cluster}) if s.port == port}
    assert "ServeReplica" in " ".join(psutil.Process(owner).cmdline())
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line]
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 4
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("argv, ready, sig, group, code", [
    # NOTE: --direct-ingress: the ingress replica answers on --port itself (a stream below)
    (["serve", "{config}", "--port", "{port}", "--dashboard", "--direct-ingress"], "serving; ",
     signal.SIGTERM, False, 0),
    # NOTE: long enough to be running when the signal comes, after the checks of the cluster's
    # processes (they scan every process on the machine: in one fresh-clone suite 150 rounds
    # of 4 clients, 16.5 s, ended first); 16 conversations within tiny's 1,024 tokens
    (["run", "--model", "tiny", "--num-prefill", "1", "--num-decode", "1", "--num-storage", "0",
      "--tenants", "4", "--clients", "4", "--rounds", "150", "--system-tokens", "8",
      "--user-tokens", "4", "--output-tokens", "2"], "round 1/", signal.SIGINT, True, 130),
], ids=["serve-sigterm", "run-ctrl-c"])
def test_a_stopped_command_leaves_no_ray_process(tmp_path: Path, argv: list[str], ready: str,
                                                 sig: signal.Signals, group: bool,
                                                 code: int) -> None:
    argv = [a.format(config=_serve_config(tmp_path), port=_free_port()) for a in argv]
    command, lines = _start(argv, tmp_path / "home", ready)
    cluster: set[Any] = set()
    try:
        token_path, cluster = _cluster_of(command)
        assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
        assert {_name(p) for p in cluster} >= {"gcs_server", "raylet"}
        _assert_http_on_loopback("".join(lines), {p.pid for p in cluster}, "--dashboard" in argv)
        if "--direct-ingress" in argv:
            _assert_streams_on(int(argv[argv.index("--port") + 1]), "".join(lines), cluster)
        # an orchestrator signals the command; Ctrl-C signals the terminal's process group
        if group:
            os.killpg(command.pid, sig)
        else:
            command.send_signal(sig)
        assert command.wait(STOP_S) == code, "".join(lines)[-3000:]
        _, alive = psutil.wait_procs(cluster, timeout=10)
        assert not alive, [(p.pid, _name(p)) for p in alive]
        assert not os.path.exists(os.path.dirname(token_path))  # the token went with it
        assert not (tmp_path / "home" / ".ray" / "auth_token").exists()  # Ray wrote none
    finally:
        _stop(command)
        for p in cluster:
            with contextlib.suppress(psutil.Error):
                p.kill()
