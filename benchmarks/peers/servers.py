"""The servers of the peer benchmark: started on 127.0.0.1 at a free port, warmed up, stopped.

    PdCache(model_dir, flags)      pd-cache serve deployments/serve_config.yaml --model DIR
    Transformers(venv, model_dir)  transformers serve DIR --continuous-batching (its own venv)
    External(url)                  any OpenAI-compatible server already running (vLLM, SGLang)

Each peer lives in a venv of its own (``ensure_venv``): torch==2.13.0 first, the CPU build,
so the peer's own torch requirement is already met and no CUDA build is downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
START_TIMEOUT_S = 300.0
WARMUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_venv(path: Path, packages: list[str]) -> Path:
    """A venv at ``path`` with torch==2.13.0, then ``packages``; built once (a marker file
    records what it holds, so a changed list rebuilds it)."""
    marker = path / ".pd-cache-peer"
    want = "\n".join([TORCH, *packages])
    if marker.exists() and marker.read_text() == want:
        return path
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, *packages], check=True)
    marker.write_text(want)
    return path


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_json(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """A server process on 127.0.0.1 (``url``), its log in ``log_path``."""

    name = "server"
    cwd = REPO

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{self.name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.model: str | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> float:
        """Start, wait for ``/v1/models``, send one request; seconds until it answered."""
        began = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, start_new_session=True,
                                         env=self.environment())
        self._wait_listening(began)
        self.model = get_json(f"{self.url}/v1/models")["data"][0]["id"]
        post_json(f"{self.url}/v1/completions",
                  {"model": self.model, "prompt": "warm up " * 16, "max_tokens": 4,
                   "temperature": 0.0}, timeout=WARMUP_TIMEOUT_S)
        return time.monotonic() - began

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def _wait_listening(self, began: float) -> None:
        while time.monotonic() - began < START_TIMEOUT_S:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see "
                                   f"{self.log_path}")
            try:
                if get_json(f"{self.url}/v1/models").get("data"):
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not listen within {START_TIMEOUT_S:.0f} s; see "
                           f"{self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class PdCache(Server):
    """``tree``: the checkout it runs from (another commit's worktree; default this one);
    ``env``: more environment variables."""

    name = "pd-cache"

    def __init__(self, log_dir: Path, model_dir: str, flags: list[str], tree: Path = REPO,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(log_dir)
        self.model_dir, self.flags, self.cwd, self.env = model_dir, flags, tree, env or {}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "pd_cache.app.cli", "serve",
                "deployments/serve_config.yaml", "--model", self.model_dir,
                "--port", str(self.port), *self.flags]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.cwd), **self.env}


class Transformers(Server):
    name = "transformers"

    def __init__(self, log_dir: Path, venv: Path, model_dir: str) -> None:
        super().__init__(log_dir)
        self.venv, self.model_dir = venv, model_dir

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "transformers"), "serve", self.model_dir,
                "--continuous-batching", "--host", "127.0.0.1", "--port", str(self.port),
                "--device", "cpu"]


class External(Server):
    """A server someone else runs: nothing to start or stop, only warmed up."""

    name = "peer"

    def __init__(self, log_dir: Path, url: str) -> None:
        super().__init__(log_dir)
        self.url = url.rstrip("/")

    def command(self) -> list[str]:
        return []

    def start(self) -> float:
        began = time.monotonic()
        self.model = get_json(f"{self.url}/v1/models")["data"][0]["id"]
        post_json(f"{self.url}/v1/completions",
                  {"model": self.model, "prompt": "warm up " * 16, "max_tokens": 4,
                   "temperature": 0.0}, timeout=WARMUP_TIMEOUT_S)
        return time.monotonic() - began

    def stop(self) -> None:
        return None
