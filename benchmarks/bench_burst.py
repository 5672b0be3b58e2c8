"""The HTTP front under a burst and under slow clients, on 127.0.0.1 only.

Serves the pd-cache app (tiny model, 1 prefill + 1 decode, no L3) through Serve's proxy on a
throwaway cluster whose job environment is the one ``pd-cache serve`` gives it (the
runtime_env of ``deployments/serve_config.yaml``), then:

1. **burst**: ``--burst`` connections at once, each sending one completion (most get 429
   beyond ``max_pending``), then ``--requests`` more, ``--concurrency`` at a time. The
   resident memory (VmRSS) of the ingress replica and of the proxy is read before, right
   after, and ``--settle-s`` later: ``burst_rss_growth_mib`` is the growth still there at
   the end (goal <= 30 MiB per process).
2. **slow clients**: ``--slow`` connections that send half a request head and nothing more,
   and as many that send nothing; after ``--slow-wait-s`` it counts those the server still
   holds open, and times one ordinary request sent meanwhile.

Each of ``--variants`` runs on a cluster of its own, one after the other in one run: the job
env ``pd-cache serve`` gives (``serve_config``) and the same with one thing changed
(``VARIANTS``), so that what each setting buys is measured side by side; the first named is
reported as ``burst_rss_growth_mib`` (ingress and proxy) and gets the slow clients.

Fixed seed; bounded in count and time; writes benchmarks/results/burst.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.serve import job_runtime_env, load_serve_config
from pd_cache.app.session import ray_session
from pd_cache.front.memory import PROXY_CALLBACK, PROXY_CALLBACK_ENV

SEED = 2024
RESULTS = Path(__file__).parent / "results" / "burst.json"
SERVE_CONFIG = Path(__file__).parents[1] / "deployments" / "serve_config.yaml"
PROCESSES = {"ingress": "ray::ServeReplica:burst:PDCacheIngress", "proxy": "ray::ProxyActor",
             "decode": "ray::DecodeActor"}
# The job environments compared, each on a cluster of its own: the runtime_env that
# ``pd-cache serve`` gives the job (serve_config.yaml's) with these env_vars changed (None:
# removed). The first one named by --variants is the one reported.
VARIANTS: dict[str, dict[str, str | None]] = {
    "serve_config": {},
    "pymalloc": {"PYTHONMALLOC": None},   # CPython's allocator in the front
    "before": {"PYTHONMALLOC": None,      # and torch in every process: the env before
               "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"},
    "malloc_arena_max_2": {"PYTHONMALLOC": None, "MALLOC_ARENA_MAX": "2"},
}
DEFAULT_VARIANTS = "serve_config,pymalloc,before"
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 1, "num_decode": 1, "num_storage": 0,
        "cluster_name": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def find_pids() -> dict[str, int]:
    """The pid of each process of ``PROCESSES``, by the title Ray gives it."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:
            continue
        for name, prefix in PROCESSES.items():
            if title.startswith(prefix):
                found[name] = int(entry)
    missing = set(PROCESSES) - set(found)
    if missing:
        raise RuntimeError(f"no process titled {[PROCESSES[m] for m in missing]}")
    return found


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> int:
    body = {"model": "tiny", "prompt": [rng.randrange(256) for _ in range(24)],
            "max_tokens": 2, "cache_salt": f"t{rng.randrange(16)}"}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


async def burst(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(SEED)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        start = time.perf_counter()
        statuses = await asyncio.gather(*(one(session, url, rng) for _ in range(args.burst)))
        burst_s = time.perf_counter() - start
    gate = asyncio.Semaphore(args.concurrency)

    async def gated(session: aiohttp.ClientSession) -> int:
        async with gate:
            return await one(session, url, rng)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        after = await asyncio.gather(*(gated(session) for _ in range(args.requests)))
        follow_s = time.perf_counter() - start
    count = lambda xs: {str(s): xs.count(s) for s in sorted(set(xs))}  # noqa: E731
    return {"burst_statuses": count(statuses), "burst_s": round(burst_s, 2),
            "follow_statuses": count(after), "follow_s": round(follow_s, 2)}


async def slow_clients(url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    half = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applic"
    conns = []
    for i in range(2 * args.slow):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if i < args.slow:
            writer.write(half)
            await writer.drain()
        conns.append((reader, writer))
    await asyncio.sleep(args.slow_wait_s / 2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        start = time.perf_counter()
        status = await one(session, url, random.Random(SEED))
        ordinary_ms = (time.perf_counter() - start) * 1e3
    await asyncio.sleep(args.slow_wait_s / 2)
    open_after = [await _still_open(reader) for reader, _ in conns]
    for _, writer in conns:
        writer.close()
    return {"slow_clients": args.slow, "slow_wait_s": args.slow_wait_s,
            "half_head_open_after_wait": sum(open_after[:args.slow]),
            "silent_open_after_wait": sum(open_after[args.slow:]),
            "ordinary_request_status": status, "ordinary_request_ms": round(ordinary_ms, 1)}


async def _still_open(reader: asyncio.StreamReader) -> bool:
    """The server has not closed it: a read neither ends nor fails within 50 ms."""
    try:
        await asyncio.wait_for(reader.read(1), 0.05)
        return False   # b"" (closed) or an answer (a 408/400 before closing)
    except asyncio.TimeoutError:
        return True
    except OSError:
        return False


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [x.decode(errors="replace").partition("=") for x in f.read().split(b"\0") if x]
    return {k: v for k, _, v in pairs}


def sample(pids: dict[str, int]) -> dict[str, float]:
    return {name: round(rss_mib(pid), 1) for name, pid in pids.items()}


def variant_env(base: dict[str, Any] | None, changes: dict[str, str | None]) -> dict[str, Any]:
    """``base`` (a runtime_env) with ``changes`` made to its env_vars (``None``: removed)."""
    env = {**(base or {})}
    env_vars = {**env.get("env_vars", {}), **changes}
    env["env_vars"] = {k: v for k, v in env_vars.items() if v is not None}
    return env


def run_variant(env: dict[str, Any], args: argparse.Namespace,
                slow: bool) -> dict[str, Any]:
    """One burst (then the slow clients if ``slow``) on a fresh cluster whose job runs in
    ``env``: RSS before, right after, ``--settle-s`` later."""
    from ray import serve

    from pd_cache.front.serve import app_builder

    port = free_port()
    with ray_session(None, runtime_env=env):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder(ARGS), name="burst", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        pids = find_pids()
        envs = {name: environ(pid) for name, pid in pids.items()}
        trims = envs["proxy"].get(PROXY_CALLBACK_ENV) == PROXY_CALLBACK
        asyncio.run(burst(url, argparse.Namespace(**{**vars(args), "burst": 32,
                                                     "requests": 64})))   # warm both up
        before = sample(pids)
        load = asyncio.run(burst(url, args))
        after = sample(pids)
        time.sleep(args.settle_s)
        settled = sample(pids)
        torch_loaded = {name: imports_torch(pid) for name, pid in pids.items()}
        slow_result = asyncio.run(slow_clients(url, port, args)) if slow else {}
        serve.shutdown()
    growth = {name: round(settled[name] - before[name], 1) for name in pids}
    return {"env_vars": env["env_vars"],
            "rss_mib": {"before": before, "after_burst": after, "settled": settled},
            "burst_rss_growth_mib": growth, "proxy_idle_trim": trims,
            "pythonmalloc": {name: env.get("PYTHONMALLOC", "pymalloc")
                             for name, env in envs.items()},
            "torch_loaded": torch_loaded, **load, **slow_result}


def imports_torch(pid: int) -> bool:
    """Whether the process has torch's C library mapped (it imported torch)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--settle-s", type=float, default=60.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--slow", type=int, default=200, help="0: no slow clients")
    parser.add_argument("--slow-wait-s", type=float, default=30.0)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, of {sorted(VARIANTS)}; the first is reported "
                             "as burst_rss_growth_mib and gets the slow clients")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    for name in ("burst", "requests", "concurrency"):
        if not 0 < getattr(args, name) <= 5000:
            parser.error(f"--{name}: 1-5000")
    if not 0 <= args.slow <= 5000:
        parser.error("--slow: 0-5000")
    if not 0 <= args.settle_s <= 600 or not 0 < args.slow_wait_s <= 300:
        parser.error("--settle-s: 0-600, --slow-wait-s: 1-300")
    names = args.variants.split(",")
    if not names or set(names) - set(VARIANTS):
        parser.error(f"--variants: of {sorted(VARIANTS)}")
    base = job_runtime_env(load_serve_config(SERVE_CONFIG))
    runs = {name: run_variant(variant_env(base, VARIANTS[name]), args, slow=i == 0 and
                              args.slow > 0) for i, name in enumerate(names)}
    first = runs[names[0]]
    result = {"config": {**{k: v for k, v in vars(args).items() if k != "out"}, "seed": SEED,
                         "app_args": ARGS, "python": platform.python_version(),
                         "cpus": os.cpu_count()},
              "variant": names[0],
              "burst_rss_growth_mib": {p: first["burst_rss_growth_mib"][p]
                                       for p in ("proxy", "ingress")},
              "goal_mib": 30, "variants": runs,
              "growth_vs_first": {name: {p: round(g - first["burst_rss_growth_mib"][p], 1)
                                         for p, g in run["burst_rss_growth_mib"].items()}
                                  for name, run in runs.items()}}
    write_result(args.out, result, show="json")


if __name__ == "__main__":
    main()
