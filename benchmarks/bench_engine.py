"""Time to first token of a 2048-token prompt: cold, 1920 tokens cached on device / host, and
the compute floor of the cached case.

One LocalEngine (``small`` preset, page size 16), cases measured side by side in each
repetition, the cached ones each in a fresh namespace (``cache_salt``) so nothing leaks:
  cold    nothing cached: the whole prompt is computed
  device  the first 1920 tokens (120 pages) were cached by an earlier request (L1 hit)
  host    the same, then every device page was evicted to host (L2 hit + load-back)
  floor   the compute floor of a cached request: the engine's own model forward over the
          128 uncached tokens, ``engine.model(prompt[1920:], prefix_kv)``, where
          ``prefix_kv`` ``[2, L, 1920, Hkv, D]`` is the prefix's KV as one contiguous
          tensor, computed once before timing. Nothing else: no page naming, matching,
          audit, locks, page gather, load-back, insert, write-through or sampling. One
          sample beside each hit (before it in even repetitions, after it in odd ones); it
          must draw the same first token as every other case.
TTFT is ``engine.prefill`` wall time: naming pages, matching, load-back, the model
forward over the uncached tokens, caching the new pages and drawing the first token.
``*_ttft_vs_floor`` = cached TTFT / floor (1.0: the cache costs nothing beyond the forward
it cannot avoid); ``ttft_vs_floor`` is the device hit's. Keys without a prefix use each
case's fastest run (the least disturbed on a shared machine), ``median_*`` the medians, and
``paired_*`` the median over repetitions of each hit over the floor sample beside it (what
the floor target is checked on: slow drifts in the machine's load cancel out of it). Run
once per write policy; the headline keys come from the default, ``write_through``; every
sample is in the JSON. ``--profile`` adds a cProfile of device-hit prefills.

    python benchmarks/bench_engine.py [--repeats R] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from pathlib import Path

import torch
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache import CacheConfig, LocalEngine, ModelConfig, PDCacheConfig, Req
from pd_cache.core.vocab import Tier

RESULTS = Path(__file__).parent / "results" / "engine.json"
SEED = 1234
PROMPT, CACHED, PAGE = 2048, 1920, 16
TARGET = 0.2            # cached TTFT / cold TTFT
FLOOR_TARGET = 1.25     # cached TTFT / compute floor (paired medians)


class Floor:
    """The compute floor of a cached request (see the module docstring)."""

    def __init__(self, engine: LocalEngine, prompt: list[int]) -> None:
        self.model, self.new = engine.model, prompt[CACHED:]
        self.prefix_kv = engine.model(prompt[:CACHED]).kv.contiguous()

    def timed(self) -> tuple[float, int]:
        start = time.perf_counter()
        out = self.model(self.new, self.prefix_kv)
        elapsed = time.perf_counter() - start
        return elapsed, int(torch.argmax(out.logits[-1]))


def timed_prefill(engine: LocalEngine, req: Req) -> tuple[float, dict[str, int], int]:
    start = time.perf_counter()
    out = engine.prefill(req)
    return time.perf_counter() - start, out.cached_tokens, out.first_token


def one_round(engine: LocalEngine, floor: Floor, prompt: list[int],
              rep: int) -> dict[str, float]:
    """Cold, device-hit and host-hit TTFT of ``prompt``, each hit in its own namespace, and
    beside each hit a floor sample (``floor_device``, ``floor_host``), timed right before or
    right after it (alternating between repetitions, so neither has the warmer caches)."""
    engine.cache.clear()
    cold, cached, first = timed_prefill(engine, Req(rid=f"cold{rep}", input_ids=prompt,
                                                    cache_salt=f"cold-{rep}", max_new_tokens=1))
    _expect(sum(cached.values()) == 0, f"cold run found cached tokens: {cached}")
    times, firsts = {"cold": cold}, {first}
    for tier in (Tier.DEVICE, Tier.HOST):
        salt = f"{tier.value}-{rep}"
        engine.prefill(Req(rid=f"warm{rep}", input_ids=prompt[:CACHED], cache_salt=salt,
                           max_new_tokens=1))
        if tier == Tier.HOST:
            engine.cache.evict(Tier.DEVICE, engine.device_pool.capacity)
        req = Req(rid=f"{tier.value}{rep}", input_ids=prompt, cache_salt=salt,
                  max_new_tokens=1)
        if rep % 2:
            t, cached, first = timed_prefill(engine, req)
            times[f"floor_{tier.value}"], floor_first = floor.timed()
        else:
            times[f"floor_{tier.value}"], floor_first = floor.timed()
            t, cached, first = timed_prefill(engine, req)
        _expect(cached[tier.value] == CACHED, f"{tier.value} run: cached {cached}")
        times[tier.value] = t
        firsts |= {first, floor_first}
    _expect(len(firsts) == 1, "cached, cold and floor runs disagree on the first token")
    _expect(engine.locks_held() == 0, "a cache lock is still held")
    return times


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark setup is wrong: {problem}")


def run_policy(policy: str, prompt: list[int], repeats: int,
               profile: bool) -> dict[str, object]:
    cfg = PDCacheConfig(model=ModelConfig.preset("small"),
                        cache=CacheConfig(page_size=PAGE, device_pages=512, host_pages=1024,
                                          write_policy=policy))
    engine = LocalEngine(cfg)
    floor = Floor(engine, prompt)
    one_round(engine, floor, prompt, -1)                 # warm-up: allocator, kernels
    rounds = [one_round(engine, floor, prompt, rep) for rep in range(repeats)]
    if profile:
        profile_hits(engine, prompt, policy)
    engine.close()
    samples = {case: [r[case] for r in rounds] for case in rounds[0]}
    samples["floor"] = samples["floor_device"] + samples["floor_host"]
    out: dict[str, object] = {}
    # NOTE: the headline uses each case's fastest run: on a machine shared with other
    # jobs that is the least disturbed one. Medians are kept alongside. A hit is compared
    # with the floor samples taken beside it (as many as its own).
    for stat, fn in (("", min), ("median_", statistics.median)):
        t = {case: fn(v) for case, v in samples.items()}
        out.update({f"{stat}cold_ttft_s": t["cold"], f"{stat}device_hit_ttft_s": t["device"],
                    f"{stat}host_hit_ttft_s": t["host"], f"{stat}floor_s": t["floor"],
                    f"{stat}device_hit_ttft_ratio": t["device"] / t["cold"],
                    f"{stat}host_hit_ttft_ratio": t["host"] / t["cold"],
                    f"{stat}device_hit_ttft_vs_floor": t["device"] / t["floor_device"],
                    f"{stat}host_hit_ttft_vs_floor": t["host"] / t["floor_host"],
                    f"{stat}ttft_vs_floor": t["device"] / t["floor_device"]})
    # NOTE: the ratio of each hit to its own floor sample, median over repetitions: what
    # drifts slowly (another job's load) cancels out of it.
    for tier in ("device", "host"):
        out[f"paired_{tier}_hit_ttft_vs_floor"] = statistics.median(
            r[tier] / r[f"floor_{tier}"] for r in rounds)
    out["samples_s"] = samples
    return out


def profile_hits(engine: LocalEngine, prompt: list[int], policy: str, n: int = 20) -> None:
    """cProfile of ``n`` device-hit prefills (the warm-up requests not profiled)."""
    prof = cProfile.Profile()
    for i in range(n):
        engine.cache.clear()
        engine.prefill(Req(rid="warm", input_ids=prompt[:CACHED], cache_salt=f"prof-{i}",
                           max_new_tokens=1))
        req = Req(rid=f"prof{i}", input_ids=prompt, cache_salt=f"prof-{i}", max_new_tokens=1)
        prof.enable()
        engine.prefill(req)
        prof.disable()
    print(f"--- {policy}: cProfile of {n} device-hit prefills, top 20 by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def report(r: dict, stat: str) -> str:
    return (f"cold {r[f'{stat}cold_ttft_s'] * 1e3:6.1f} ms | floor "
            f"{r[f'{stat}floor_s'] * 1e3:5.1f} ms | device hit "
            f"{r[f'{stat}device_hit_ttft_s'] * 1e3:5.1f} ms "
            f"({r[f'{stat}device_hit_ttft_ratio']:.3f}x cold, "
            f"{r[f'{stat}device_hit_ttft_vs_floor']:.3f}x floor) | host hit "
            f"{r[f'{stat}host_hit_ttft_s'] * 1e3:5.1f} ms "
            f"({r[f'{stat}host_hit_ttft_ratio']:.3f}x cold, "
            f"{r[f'{stat}host_hit_ttft_vs_floor']:.3f}x floor)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of device-hit prefills")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    vocab = ModelConfig.preset("small").vocab_size
    rng = random.Random(SEED)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
    print(f"torch threads: {torch.get_num_threads()}  preset: small  prompt: {PROMPT} tokens, "
          f"{CACHED} cached  page size: {PAGE}  repeats: {args.repeats}")
    results = {policy: run_policy(policy, prompt, args.repeats, args.profile)
               for policy in ("write_through", "write_back")}
    for policy, r in results.items():
        for stat in ("", "median_"):
            print(f"{policy:>13} {stat[:-1] or 'min':>6}: " + report(r, stat))
    head = results["write_through"]
    ok = max(head["device_hit_ttft_ratio"], head["host_hit_ttft_ratio"]) <= TARGET
    print(f"target cached TTFT <= {TARGET}x cold: {'met' if ok else 'NOT met'}")
    for policy, r in results.items():
        print(f"{policy:>13} paired: device hit {r['paired_device_hit_ttft_vs_floor']:.3f}x "
              f"floor | host hit {r['paired_host_hit_ttft_vs_floor']:.3f}x floor")
    vs_floor = max(head["paired_device_hit_ttft_vs_floor"],
                   head["paired_host_hit_ttft_vs_floor"])
    floor_ok = vs_floor <= FLOOR_TARGET
    print(f"ttft_vs_floor {head['ttft_vs_floor']:.3f} (median {head['median_ttft_vs_floor']:.3f}"
          f", paired {head['paired_device_hit_ttft_vs_floor']:.3f}); target cached TTFT <= "
          f"{FLOOR_TARGET}x floor (paired medians, device and host): "
          f"{'met' if floor_ok else 'NOT met'} ({vs_floor:.3f}x)")
    summary = {k: v for k, v in head.items() if k != "samples_s"}
    write_result(RESULTS, {
        "benchmark": "engine_ttft", "seed": SEED, "preset": "small",
        "torch_threads": torch.get_num_threads(), "prompt_tokens": PROMPT,
        "cached_tokens": CACHED, "page_size": PAGE, "repeats": args.repeats, **summary,
        "target_ratio": TARGET, "target_met": ok, "floor_target_ratio": FLOOR_TARGET,
        "floor_target_met": floor_ok, "by_write_policy": results,
    }, show="name")


if __name__ == "__main__":
    main()
