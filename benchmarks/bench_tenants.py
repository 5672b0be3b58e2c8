"""A quiet tenant beside a noisy one: the quiet one's hit rate, the noisy one's L3 bytes.

Serves the pd-cache app with an API-key file on a throwaway local cluster (127.0.0.1 only),
with ``make run``'s cluster (small model, 16-token pages, 2 prefill, 2 decode, 2 L3 shards,
48 device and 96 host pages per worker, 1 GiB of L3), and drives it over HTTP:

- tenant **Q**: 8 users sharing a 1k-token system prompt, each request the system prompt
  and 64 new tokens of its user's, ``--quiet-rate`` requests/s (1) in all, the prefix pinned
  with the extension ``"pd_cache": {"pin_ttl_s": --pin-ttl-s}`` (0: no pin);
- tenant **N**: unique 2k-token prompts at ``--noisy-rate`` requests/s (10), with
  ``l3_quota_bytes`` = ``--noisy-quota-mib`` (64) in the key file.

Each of the pinned and unpinned modes runs Q alone and then Q with N, ``--seconds`` (60)
each, every tier emptied before each (``/admin/drop_caches``) and Q's system prompt then
computed once (a warm-up request, not counted). Q's hit rate is its cached prompt tokens
over its prompt tokens (``usage``, requests served); ``quiet_hit_ratio`` is
Q's hit rate with N over Q's alone (target >= 0.95). N's L3 bytes are read from the shards
by N's owner label every ``--sample-s`` (``noisy_l3_bytes_max``; never above its quota).

``--runs`` repeats each pair (Q alone, Q with N) back to back; each mode's figures are
the medians over the pairs (``quiet_hit_ratio``, Q served beside N), ``noisy_l3_bytes_max``
the largest seen. ``targets`` says whether each target held (on the medians).

``--no-quota`` is the control: the same load with N unbounded. Open loop, fixed seed and
schedule (the same requests in every run); writes benchmarks/results/tenants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache.app.session import ray_session
from pd_cache.core.sealing import Keyring, read_or_create_secret

SEED = 2028
RESULTS = Path(__file__).parent / "results" / "tenants.json"
MIB = 1 << 20
KEYS = {"quiet": "sk-quiet-0001", "noisy": "sk-noisy-0002", "ops": "sk-ops-000003"}
# NOTE: make run's cluster (Makefile RUN_ARGS and ClusterConfig's defaults).
CLUSTER = {"model": "small", "page_size": 16, "num_prefill": 2, "num_decode": 2,
           "num_storage": 2, "device_pages": 48, "host_pages": 96,
           "storage_capacity_bytes": 1 << 30, "metrics_interval_s": 1.0}
SYSTEM_LEN, USER_LEN, NOISY_LEN, USERS = 1024, 64, 2048, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key_file(directory: Path, quota: int | None) -> Path:
    path = directory / "keys.json"
    path.write_text(json.dumps({
        "keys": {KEYS["quiet"]: "Q", KEYS["noisy"]: "N",
                 KEYS["ops"]: {"tenant": "ops", "admin": True}},
        "tenants": {} if quota is None else {"N": {"l3_quota_bytes": quota}}}))
    return path


def schedule(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Poisson arrival times (s) over ``seconds``."""
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def workload(args: argparse.Namespace, vocab: int) -> dict[str, list[tuple[float, dict]]]:
    """Each tenant's requests: (send time, body), the same in every run."""
    rng = random.Random(SEED)
    system = [rng.randrange(vocab) for _ in range(SYSTEM_LEN)]
    pin = {"pd_cache": {"pin_ttl_s": args.pin_ttl_s}} if args.pin_ttl_s else {}
    quiet = [(t, {"model": "small", "max_tokens": args.max_tokens, "user": f"u{i % USERS}",
                  "prompt": system + [rng.randrange(vocab) for _ in range(USER_LEN)], **pin})
             for i, t in enumerate([0.0] + schedule(args.quiet_rate, args.seconds, rng))]
    noisy = [(t, {"model": "small", "max_tokens": args.max_tokens,
                  "prompt": [rng.randrange(vocab) for _ in range(NOISY_LEN)]})
             for t in schedule(args.noisy_rate, args.seconds, rng)]
    return {"warm-up": quiet[:1], "Q": quiet[1:], "N": noisy}


async def send(session: aiohttp.ClientSession, url: str, key: str, at: float, start: float,
               body: dict) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as r:
            answer = await r.json(content_type=None)
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"status": 0, "error": type(e).__name__}
    if status != 200:
        return {"status": status}
    usage = answer["usage"]
    return {"status": 200, "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "seconds": time.perf_counter() - sent}


def shards() -> list[Any]:
    """The L3 shards of the app's cluster (its only storage actors on this Ray cluster)."""
    import ray

    named = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "pd-cache" and "/storage-" in a["name"]]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in named]


async def sample(owner: bytes, every_s: float, stop: asyncio.Event) -> list[int]:
    """The noisy tenant's L3 bytes over every shard, every ``every_s`` until ``stop``."""
    import ray

    tiers, got = shards(), []
    while not stop.is_set():
        held = await asyncio.to_thread(ray.get, [s.owner_bytes.remote() for s in tiers])
        got.append(sum(h.get(owner, 0) for h in held))
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    return got


async def one_run(url: str, load: dict[str, list[tuple[float, dict]]], noisy: bool,
                  owner: bytes, args: argparse.Namespace) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async with session.post(f"{url}/admin/drop_caches",
                                headers={"Authorization": f"Bearer {KEYS['ops']}"}) as r:
            assert r.status == 200, await r.text()
        # NOTE: Q's system prompt computed (and pinned) first, so the hit rate is what the
        # cache kept of it, not the one cold request's weight among those served.
        (at, body), = load["warm-up"]
        assert (await send(session, url, KEYS["quiet"], at, time.perf_counter(), body))[
            "status"] == 200
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(owner, args.sample_s, stop))
        start = time.perf_counter()
        quiet = [send(session, url, KEYS["quiet"], t, start, b) for t, b in load["Q"]]
        loud = [send(session, url, KEYS["noisy"], t, start, b) for t, b in load["N"]] \
            if noisy else []
        done = await asyncio.gather(asyncio.gather(*quiet), asyncio.gather(*loud))
        stop.set()
        held = await sampler
    return {"noisy": noisy, "wall_s": round(time.perf_counter() - start, 1),
            "Q": summary(done[0]), "N": summary(done[1]) if noisy else None,
            "noisy_l3_bytes_max": max(held, default=0), "noisy_l3_samples": len(held)}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200]
    statuses = [r["status"] for r in results]
    prompt, cached = sum(r["prompt"] for r in ok), sum(r["cached"] for r in ok)
    latency = sorted(r["seconds"] for r in ok)
    return {"sent": len(results), "served": len(ok),
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "latency_p50_s": round(latency[len(latency) // 2], 3) if latency else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from pd_cache.core.cluster_config import ClusterConfig
    from pd_cache.front.serve import app_builder

    quota = None if args.no_quota else args.noisy_quota_mib * MIB
    vocab = ClusterConfig(model=CLUSTER["model"]).pd_config.model.vocab_size
    modes = {"pinned": args.pin_ttl_s, "unpinned": 0} if args.pin_ttl_s else {"unpinned": 0}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        keys = key_file(Path(tmp), quota)
        # NOTE: the server's secret, made here first, so N's owner label is known here.
        owner = Keyring(read_or_create_secret(keys.with_name(keys.name + ".secret"))).owner("N")
        port = free_port()
        with ray_session(None):
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(app_builder({**CLUSTER, "api_keys_file": str(keys),
                                   "cluster_name": None, "max_pending": args.max_pending}),
                      name="tenants", route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            for mode, ttl in modes.items():
                load = workload(argparse.Namespace(**{**vars(args), "pin_ttl_s": ttl}), vocab)
                out[mode] = {"pin_ttl_s": ttl, "runs": [
                    asyncio.run(one_run(url, load, noisy, owner, args))
                    for _ in range(args.runs) for noisy in (False, True)]}
                print(mode, json.dumps(out[mode]["runs"], indent=None))
            serve.shutdown()
    return figures(out, quota)


def figures(out: dict[str, Any], quota: int | None) -> dict[str, Any]:
    for mode in out.values():
        pairs = list(zip(mode["runs"][::2], mode["runs"][1::2]))
        ratios = [ratio(beside["Q"]["hit_rate"], alone["Q"]["hit_rate"])
                  for alone, beside in pairs]
        mode["quiet_hit_ratios"] = ratios
        mode["quiet_hit_ratio"] = median([r for r in ratios if r is not None])
        mode["noisy_l3_bytes_max"] = max(beside["noisy_l3_bytes_max"] for _, beside in pairs)
        mode["quiet_served_beside_noisy"] = median([b["Q"]["served"] for _, b in pairs])
        mode["quiet_sent"] = pairs[0][1]["Q"]["sent"]
        mode["noisy_served"] = median([b["N"]["served"] for _, b in pairs])
        mode["noisy_sent"] = pairs[0][1]["N"]["sent"]
    first = next(iter(out.values()))
    held = max(m["noisy_l3_bytes_max"] for m in out.values())
    return {"quiet_hit_ratio": first["quiet_hit_ratio"],
            "quiet_hit_ratio_unpinned": out["unpinned"]["quiet_hit_ratio"],
            "noisy_l3_bytes_max": held, "noisy_l3_quota_bytes": quota,
            "quiet_served_beside_noisy": {name: f"{m['quiet_served_beside_noisy']} of "
                                                f"{m['quiet_sent']}" for name, m in out.items()},
            "targets": {"quiet_hit_ratio >= 0.95": {
                            name: m["quiet_hit_ratio"] is not None and m["quiet_hit_ratio"] >= 0.95
                            for name, m in out.items()},
                        "noisy_l3_bytes_max <= l3_quota_bytes":
                        None if quota is None else held <= quota},
            "modes": out}


def median(values: list[float]) -> float | None:
    return statistics.median_low(values) if values else None   # one of the runs' own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="each run's length")
    p.add_argument("--quiet-rate", type=float, default=1.0, help="Q's requests/s")
    p.add_argument("--noisy-rate", type=float, default=10.0, help="N's requests/s")
    p.add_argument("--noisy-quota-mib", type=int, default=64, help="N's l3_quota_bytes")
    p.add_argument("--no-quota", action="store_true",
                   help="the control: N without a quota (with --output elsewhere)")
    p.add_argument("--pin-ttl-s", type=int, default=600,
                   help="Q's pin (the pd_cache.pin_ttl_s extension); 0 runs unpinned only")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-pending", type=int, default=256, help="the ingress's bound")
    p.add_argument("--sample-s", type=float, default=0.5, help="N's L3 bytes read every")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--runs", type=int, default=1, help="pairs of runs per mode (medians)")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    result = {"benchmark": "bench_tenants", "seed": SEED,
              "args": {k: v for k, v in vars(args).items() if k != "output"},
        "cluster": CLUSTER, "machine": platform.machine(), **run(args)}
    write_result(args.output, result, show=None)
    quota = "no" if args.no_quota else f"a {args.noisy_quota_mib} MiB"
    print(f"quiet_hit_ratio {result['quiet_hit_ratio']} (unpinned "
          f"{result['quiet_hit_ratio_unpinned']}); noisy_l3_bytes_max "
          f"{result['noisy_l3_bytes_max'] / MIB:.1f} MiB with {quota} quota; Q served beside N "
          f"{result['quiet_served_beside_noisy']}; targets {result['targets']} -> {args.output}")


if __name__ == "__main__":
    main()
