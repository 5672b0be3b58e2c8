"""L3 prefetch: TTFT of a 2048-token prompt whose first 1920 tokens are in L3, vs cold.

``small`` preset, page size 16. Each repetition measures side by side, in its own
namespace (``cache_salt``):
  cold     a fresh engine without L3 computes the whole prompt
  l3_hit   a fresh engine (empty device and host) whose L3 holds the first 1920 tokens
           (written there by a donor engine): hit query, prefetch into host slots with
           verification, the model over the last 128 tokens, write-through of the new page
  zero-reuse overhead: unique prompts through an engine with L3 vs one without (prefill
           wall time; the write-through runs in the background and is flushed untimed)
  sealed   the L3-hit TTFT through sealed records vs unsealed ones (``storage.seal:
           false``), same backend, alternating (``--sealed-only``: just these rows, into
           results/controller_sealed.json)
The main figures use an in-process ``memory`` backend; ``--ray`` adds one StorageTier
actor on a throwaway local Ray cluster (a token of its own), shut down at the end.
TTFT is ``engine.prefill`` wall time; headline figures use each case's fastest run.

    python benchmarks/bench_controller.py [--repeats R] [--threads N] [--ray] [--sealed-only]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from results_io import write_result  # this folder: the tail every benchmark shares

from pd_cache import (
    CacheConfig,
    LocalEngine,
    ModelConfig,
    PDCacheConfig,
    Req,
    StorageConfig,
    make_backend,
)
from pd_cache.core.sealing import Keyring
from pd_cache.storage.base import StorageBackend
from pd_cache.storage.seal import SCRATCH_BYTES, SealedStorage, Sealer

RESULTS = Path(__file__).parent / "results" / "controller.json"
SEED = 4321
PROMPT, CACHED, PAGE = 2048, 1920, 16
HIT_TARGET, OVERHEAD_TARGET = 0.3, 0.05
UNIQUE = 4           # prompts per zero-reuse round
SEALED_TARGET = 1.10   # L3-hit TTFT through sealed records vs unsealed ones


def make_config() -> PDCacheConfig:
    return PDCacheConfig(model=ModelConfig.preset("small"),
                         cache=CacheConfig(page_size=PAGE, device_pages=256, host_pages=256),
                         storage=StorageConfig(prefetch_policy="wait_complete"))


def timed(engine: LocalEngine, req: Req) -> tuple[float, dict[str, int], int]:
    start = time.perf_counter()
    out = engine.prefill(req)
    return time.perf_counter() - start, out.cached_tokens, out.first_token


def hit_round(cfg: PDCacheConfig, storage: StorageBackend, prompt: list[int],
              rep: int) -> dict[str, float]:
    salt = f"rep-{rep}"
    donor = LocalEngine(cfg, storage=storage)
    donor.prefill(Req(rid=f"donor{rep}", input_ids=prompt[:CACHED], cache_salt=salt,
                      max_new_tokens=1))
    _expect(donor.flush(60), "donor write-through did not finish")
    donor.close()
    cold_engine, hit_engine = LocalEngine(cfg), LocalEngine(cfg, storage=storage)
    cold, cached, first_cold = timed(cold_engine, Req(rid=f"cold{rep}", input_ids=prompt,
                                                      cache_salt=salt, max_new_tokens=1))
    _expect(sum(cached.values()) == 0, f"cold run found cached tokens {cached}")
    hit, cached, first_hit = timed(hit_engine, Req(rid=f"hit{rep}", input_ids=prompt,
                                                   cache_salt=salt, max_new_tokens=1))
    _expect(cached == {"device": 0, "host": 0, "storage": CACHED}, f"L3 run cached {cached}")
    _expect(first_cold == first_hit, "cold and L3 runs disagree on the first token")
    hit_engine.flush(60)
    for e in (cold_engine, hit_engine):
        e.close()
    return {"cold": cold, "l3_hit": hit}


def overhead_round(with_l3: LocalEngine, without: LocalEngine, rng: random.Random,
                   vocab: int) -> dict[str, float]:
    """Unique prompts (nothing to reuse anywhere) through both engines, alternating."""
    total = {"l3_on": 0.0, "l3_off": 0.0}
    for i in range(UNIQUE):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
        pair = [("l3_on", with_l3), ("l3_off", without)]
        for name, engine in pair if i % 2 == 0 else pair[::-1]:   # alternate who goes first
            t, cached, _ = timed(engine, Req(rid=f"u{i}", input_ids=prompt, max_new_tokens=1))
            _expect(sum(cached.values()) == 0, f"zero-reuse run found cached tokens {cached}")
            total[name] += t
            engine.flush(60)
            engine.cache.clear()
    return total


def measure(label: str, cfg: PDCacheConfig, storage: StorageBackend, repeats: int,
            prompt: list[int]) -> dict[str, Any]:
    vocab = cfg.model.vocab_size
    hit_round(cfg, storage, prompt, -1)                   # warm-up
    hits = [hit_round(cfg, storage, prompt, rep) for rep in range(repeats)]
    with_l3, without = LocalEngine(cfg, storage=storage), LocalEngine(cfg)
    rng = random.Random(SEED + 1)
    overhead_round(with_l3, without, rng, vocab)          # warm-up
    zero = [overhead_round(with_l3, without, rng, vocab) for _ in range(repeats)]
    stats = with_l3.controller_stats()
    for e in (with_l3, without):
        e.close()
    best = {k: min(h[k] for h in hits) for k in hits[0]}
    med = {k: statistics.median(h[k] for h in hits) for k in hits[0]}
    on, off = min(z["l3_on"] for z in zero), min(z["l3_off"] for z in zero)
    med_on = statistics.median(z["l3_on"] for z in zero)
    med_off = statistics.median(z["l3_off"] for z in zero)
    out = {
        "backend": label, "cold_ttft_s": best["cold"], "l3_hit_ttft_s": best["l3_hit"],
        "l3_hit_ttft_ratio": best["l3_hit"] / best["cold"],
        "median_l3_hit_ttft_ratio": med["l3_hit"] / med["cold"],
        "zero_reuse_l3_on_s": on / UNIQUE, "zero_reuse_l3_off_s": off / UNIQUE,
        "zero_reuse_overhead": on / off - 1, "median_zero_reuse_overhead": med_on / med_off - 1,
        "samples_s": {"hit": hits, "zero_reuse": zero}, "counts": stats,
    }
    print(f"{label:>12}: cold {best['cold'] * 1e3:7.1f} ms | L3 hit {best['l3_hit'] * 1e3:6.1f} "
          f"ms ({out['l3_hit_ttft_ratio']:.3f}x, median {out['median_l3_hit_ttft_ratio']:.3f}x)"
          f" | zero reuse {on / UNIQUE * 1e3:6.1f} vs {off / UNIQUE * 1e3:6.1f} ms "
          f"({out['zero_reuse_overhead'] * 100:+.1f}%, median "
          f"{out['median_zero_reuse_overhead'] * 100:+.1f}%)")
    return out


def sealed_rows(label: str, cfg: PDCacheConfig, storage: StorageBackend, repeats: int,
                prompt: list[int]) -> dict[str, Any]:
    """L3-hit TTFT through sealed records against unsealed ones (``storage.seal: false``),
    over the same backend, alternating which goes first; medians and best of each."""
    keys = Keyring.random()
    stores = {label: SealedStorage(storage, sealer, scratch_bytes=SCRATCH_BYTES)   # a worker's
              for label, sealer in (("unsealed", Sealer(keys, enabled=False)),
                                    ("sealed", Sealer(keys)))}
    for i, store in enumerate(stores.values()):
        hit_round(cfg, store, prompt, -10 - i)            # warm-up
    times: dict[str, list[float]] = {k: [] for k in stores}
    for rep in range(repeats):
        order = list(stores) if rep % 2 == 0 else list(stores)[::-1]
        for i, name in enumerate(order):
            times[name].append(hit_round(cfg, stores[name], prompt, 1000 + 2 * rep + i)["l3_hit"])
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"backend": label, "sealed_l3_hit_ttft_s": min(times["sealed"]),
           "unsealed_l3_hit_ttft_s": min(times["unsealed"]),
           "median_sealed_l3_hit_ttft_s": med["sealed"],
           "median_unsealed_l3_hit_ttft_s": med["unsealed"],
           "sealed_vs_unsealed_ttft": med["sealed"] / med["unsealed"], "samples_s": times}
    print(f"{label:>12}: L3-hit TTFT sealed {out['sealed_l3_hit_ttft_s'] * 1e3:6.1f} ms vs "
          f"unsealed {out['unsealed_l3_hit_ttft_s'] * 1e3:6.1f} ms (medians: "
          f"{out['sealed_vs_unsealed_ttft']:.3f}x; target <= {SEALED_TARGET}x)")
    return out


def with_ray(fn: Callable[[StorageBackend], dict[str, Any]], cfg: PDCacheConfig) -> dict:
    import ray

    from pd_cache.app.session import cluster_token
    from pd_cache.storage.client import StorageClient
    from pd_cache.storage.tier import storage_actors

    with cluster_token():   # a throwaway cluster of its own, token-authenticated
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 logging_level="WARNING",
                 runtime_env={"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
                                           "OMP_NUM_THREADS": "1"}})
        try:
            handles = storage_actors(cfg)
            ray.get([h.ping.remote() for h in handles])
            return fn(StorageClient(handles, timeout_s=60.0))
        finally:
            ray.shutdown()


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark setup is wrong: {problem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ray", action="store_true", help="also one StorageTier actor")
    parser.add_argument("--sealed-only", action="store_true",
                        help="only sealed vs unsealed L3-hit TTFT (controller_sealed.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    cfg = make_config()
    rng = random.Random(SEED)
    prompt = [rng.randrange(cfg.model.vocab_size) for _ in range(PROMPT)]
    print(f"torch threads: {torch.get_num_threads()}  preset: small  prompt: {PROMPT} tokens, "
          f"{CACHED} in L3  page size: {PAGE}  repeats: {args.repeats}")
    if args.sealed_only:
        return run_sealed(args, cfg, prompt)
    memory = measure("memory", cfg, make_backend(cfg.storage, cfg.layout), args.repeats,
                     prompt)
    memory["sealed"] = sealed_rows("memory", cfg, make_backend(cfg.storage, cfg.layout),
                                   args.repeats, prompt)
    results = {"memory": memory}
    if args.ray:
        results["tier_actor"] = with_ray(
            lambda client: measure("tier_actor", cfg, client, args.repeats, prompt), cfg)
    hit_ok = memory["l3_hit_ttft_ratio"] <= HIT_TARGET
    over_ok = memory["zero_reuse_overhead"] <= OVERHEAD_TARGET
    print(f"target L3 hit TTFT <= {HIT_TARGET}x cold: {'met' if hit_ok else 'NOT met'}; "
          f"zero-reuse overhead <= {OVERHEAD_TARGET:.0%}: {'met' if over_ok else 'NOT met'}")
    headline = {k: v for k, v in memory.items() if k not in ("samples_s", "counts", "sealed")}
    write_result(RESULTS, {
        "benchmark": "controller_l3", "seed": SEED, "preset": "small",
        "torch_threads": torch.get_num_threads(), "prompt_tokens": PROMPT,
        "cached_tokens": CACHED, "page_size": PAGE, "repeats": args.repeats,
        "prefetch_policy": cfg.storage.prefetch_policy, **headline,
        "targets": {"l3_hit_ttft_ratio": HIT_TARGET, "zero_reuse_overhead": OVERHEAD_TARGET},
        "targets_met": {"l3_hit_ttft_ratio": hit_ok, "zero_reuse_overhead": over_ok},
        "by_backend": results,
    }, show="name")


def run_sealed(args: argparse.Namespace, cfg: PDCacheConfig, prompt: list[int]) -> None:
    rows = {"memory": sealed_rows("memory", cfg, make_backend(cfg.storage, cfg.layout),
                                  args.repeats, prompt)}
    if args.ray:
        rows["tier_actor"] = with_ray(
            lambda client: sealed_rows("tier_actor", cfg, client, args.repeats, prompt), cfg)
    write_result(RESULTS.with_name("controller_sealed.json"), {
        "benchmark": "controller_sealed", "seed": SEED, "preset": "small",
        "prompt_tokens": PROMPT, "cached_tokens": CACHED, "repeats": args.repeats,
        "target_sealed_vs_unsealed_ttft": SEALED_TARGET, **rows}, show="name")


if __name__ == "__main__":
    main()
