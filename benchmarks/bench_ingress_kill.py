"""An ingress replica killed under load: what clients see, with 1 and with 2 replicas.

For each replica count, a local Ray cluster serves the tiny model (2 prefill, 2 decode
workers, a named cluster) behind Serve's proxy on 127.0.0.1. Six clients send
non-streaming completions (32 tokens) in a loop and four streams of 600 tokens are open
when ``kill -9`` hits replica 0. Recorded: how the requests in flight at the kill ended
(status, and whether the body was OpenAI's JSON), the status and latency of every request
sent after it, how each stream ended (``[DONE]``, an error event, or cut: the exception
the client read), and the time until Serve has the replica back.

Writes benchmarks/results/ingress_kill.json (per replica count: ``after_kill_failed``,
``after_kill_p50_ms`` / ``_max_ms``, ``in_flight`` and ``streams`` outcomes,
``replica_back_s``). Goal with 2 replicas: after_kill_failed == 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from results_io import write_result  # this folder: the tail every benchmark shares

SEED = 1234
NAME = "bench-ingress-kill"
RESULTS = Path(__file__).parent / "results" / "ingress_kill.json"
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 2, "num_decode": 2, "num_storage": 1,
        "device_pages": 64, "host_pages": 128, "cluster_name": NAME}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict[str, Any]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def one(port: int, seed: int) -> tuple[int, str]:
    """Status and the kind of body: ``json`` (OpenAI's shape) or its first bytes."""
    body = {"model": "tiny", "prompt": [seed % 500 + 1] * 12, "max_tokens": 32}
    try:
        resp = post(port, "/v1/completions", body)
        raw = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return 0, type(exc).__name__
    try:
        json.loads(raw)
        return resp.status, "json"
    except ValueError:
        return resp.status, raw[:40].decode("utf-8", "replace")


def stream(port: int, seed: int) -> str:
    """How a long stream ended: ``done``, ``error-event`` or ``cut: <exception>``."""
    body = {"model": "tiny", "prompt": [seed + 1] * 12, "max_tokens": 600,
            "ignore_eos": True, "stream": True}
    last = ""
    try:
        resp = post(port, "/v1/completions", body)
        for line in resp:
            if line.startswith(b"data: "):
                last = line.decode().strip()
    except (OSError, http.client.HTTPException) as exc:
        return f"cut: {type(exc).__name__}"
    if last == "data: [DONE]":
        return "done"
    return "error-event" if '"error"' in last else f"cut: ended after {last[:30]!r}"


def replicas(app: str) -> list[int]:
    from ray._private import state

    return [info["Pid"] for info in state.actors().values()
            if info["ActorClassName"].endswith(f"{app}:PDCacheIngress")
            and info["State"] == "ALIVE"]


def run(n_replicas: int, after_s: float) -> dict[str, Any]:
    from ray import serve

    from pd_cache.cluster.pd_cluster import PDCluster
    from pd_cache.front.serve import app_builder

    port, app = free_port(), f"kill-{n_replicas}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder({**ARGS, "ingress_replicas": n_replicas}), name=app,
              route_prefix="/")
    records: list[tuple[float, float, int, str]] = []   # sent, latency, status, body kind
    killed_at, stop = [float("inf")], threading.Event()

    def client(i: int) -> None:
        seed = SEED + i * 1000
        while not stop.is_set():
            seed += 1
            sent = time.monotonic()
            status, kind = one(port, seed)
            records.append((sent, time.monotonic() - sent, status, kind))

    loops = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    streams: list[str] = []
    readers = [threading.Thread(target=lambda s=s: streams.append(stream(port, s)))
               for s in range(4)]
    for t in loops + readers:
        t.start()
    while len(records) < 24:
        time.sleep(0.05)
    victim = replicas(app)[0]
    killed_at[0] = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while len([p for p in replicas(app) if p != victim]) < n_replicas:
        time.sleep(0.1)
    back_s = time.monotonic() - killed_at[0]
    time.sleep(max(0.0, after_s - back_s))
    stop.set()
    for t in loops + readers:
        t.join()
    serve.delete(app)
    serve.shutdown()
    PDCluster.destroy(NAME)
    in_flight = [r for r in records if r[0] < killed_at[0] < r[0] + r[1]]
    after = [r for r in records if r[0] >= killed_at[0]]
    latencies = [r[1] * 1e3 for r in after]
    return {"replicas": n_replicas, "replica_back_s": round(back_s, 2),
            "in_flight": dict(Counter(f"{r[2]} {r[3]}" for r in in_flight)),
            "after_kill_requests": len(after),
            "after_kill_failed": sum(r[2] != 200 for r in after),
            "after_kill_p50_ms": round(statistics.median(latencies), 1),
            "after_kill_max_ms": round(max(latencies), 1),
            "streams": dict(Counter(streams))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--after-s", type=float, default=20.0,
                        help="load kept on after the kill (at least until the replica is back)")
    args = parser.parse_args()
    from pd_cache.app.session import ray_session

    with ray_session(None):
        runs = [run(n, args.after_s) for n in (1, 2)]
    write_result(RESULTS, {"seed": SEED, "runs": runs}, show="json")


if __name__ == "__main__":
    main()
