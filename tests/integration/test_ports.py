"""A throwaway cluster opens no HTTP port beyond loopback.

``pd-cache serve --dashboard`` starts its cluster as every pd-cache command does; every TCP
socket its processes listen on is listed from ``/proc`` and sent a plain GET. Those that
answer HTTP (metrics export, autoscaler and dashboard metrics, dashboard, dashboard and
runtime-env agents, Serve's proxy) have no token in front of them and must be bound to
loopback; Ray's gRPC servers (token-authenticated) do not answer a GET and are exempt.
The same run checks that the cluster flags reach the app and that the metrics URL is printed.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.listening import descendants, listeners, speaks_http
from tests.integration.serving import free_port

ROOT = Path(__file__).resolve().parents[2]
START_S, STOP_S = 120, 60
pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux /proc")


def _start_serve(port: int) -> tuple[subprocess.Popen[str], list[str]]:
    argv = [sys.executable, "-m", "pd_cache.app.cli", "serve",
            str(ROOT / "deployments" / "serve_config.yaml"), "--port", str(port),
            "--dashboard", "--model", "tiny", "--num-prefill", "1", "--num-decode", "1",
            "--num-storage", "0"]
    command = subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in command.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("serving; "):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_S
    while not ready.wait(0.5):
        if command.poll() is not None or time.monotonic() > deadline:
            command.kill()
            pytest.fail(f"pd-cache serve did not start:\n{''.join(lines)[-3000:]}")
    return command, lines


def test_serve_opens_no_http_port_beyond_loopback() -> None:
    port = free_port()
    command, lines = _start_serve(port)
    try:
        found = [s for s in listeners(descendants(command.pid)) if speaks_http(s)]
        text = "".join(lines)
        metrics = re.search(r"Ray metrics \(Prometheus text\): (http://\S+)", text)
        assert metrics, text[-3000:]
        with urllib.request.urlopen(metrics.group(1), timeout=10) as r:
            assert b"ray_" in r.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny"]   # --model reached it
    finally:
        command.send_signal(signal.SIGTERM)
        command.wait(STOP_S)
    metrics_port = int(metrics.group(1).rsplit(":", 1)[1].split("/")[0])
    dashboard = re.search(r"Ray dashboard: http://127\.0\.0\.1:(\d+)", text)
    assert dashboard, text[-3000:]
    http_ports = {s.port for s in found}
    assert {port, metrics_port, int(dashboard.group(1))} <= http_ports, found
    assert [s for s in found if not s.loopback] == []
