"""Render the dashboard's main panels from series scraped off a real run (docs/metrics.png).

Grafana is not needed: a local Ray cluster with a metrics port runs a ``PDCluster`` (2
prefill, 1 decode, 1 storage) through rounds of multi-turn traffic, each turn on the other
prefill worker so that L3 serves it; the metrics port is scraped once a second and the
panels are computed from the counters and histograms as the PromQL of
``k8s/grafana/pd-cache-dashboard.json`` computes them. Fixed seed.

    python benchmarks/plot_metrics.py [--out docs/metrics.png] [--rounds 12]
"""

from __future__ import annotations

import argparse
import random
import socket
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
KEEP = {"tier", "role", "outcome", "le"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> Series:
    """Every ray_pd_cache_ sample, summed over processes, keyed by the labels we plot."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8")
    out: Series = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_pd_cache_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in KEEP))
                out[(s.name[len("ray_pd_cache_"):], labels)] += s.value
    return out


def total(series: Series, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in series.items()
               if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def quantile(q: float, before: Series, after: Series, name: str) -> float:
    """histogram_quantile over the increase of ``name``'s buckets between two scrapes."""
    buckets = sorted((float(dict(ls)["le"]), v - before.get((n, ls), 0.0))
                     for (n, ls), v in after.items() if n == name + "_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return prev_le


def run(rounds: int, port: int) -> list[tuple[float, Series]]:
    import ray

    from pd_cache import ClusterConfig, PDCluster, Req

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000})
    config = ClusterConfig(num_prefill=2, num_decode=1, num_storage=1, model="tiny",
                           page_size=4, device_pages=64, host_pages=128,
                           metrics_interval_s=0.5)
    cluster = PDCluster.start(config)
    rng, vocab = random.Random(0), config.pd_config.model.vocab_size
    shots, start = [], time.monotonic()
    history = {t: [rng.randrange(vocab) for _ in range(40)] for t in range(4)}
    for r in range(rounds):
        for tenant, prompt in history.items():
            req = Req(rid=f"t{tenant}-{r}", input_ids=prompt, cache_salt=f"tenant-{tenant}",
                      max_new_tokens=16)
            out = cluster.generate(req, prefill_worker=r % 2)
            history[tenant] = prompt + out.output_ids + [rng.randrange(vocab) for _ in range(8)]
        cluster.flush()
        time.sleep(1.0)
        shots.append((time.monotonic() - start, scrape(port)))
    time.sleep(2.5)
    shots.append((time.monotonic() - start, scrape(port)))
    cluster.shutdown()
    ray.shutdown()
    return shots


def plot(shots: list[tuple[float, Series]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [b[0] for b in shots[1:]]
    pairs = list(zip(shots, shots[1:]))

    def rate(name: str, **labels: str) -> list[float]:
        return [(total(b, name, **labels) - total(a, name, **labels)) / (tb - ta)
                for (ta, a), (tb, b) in pairs]

    fig, ax = plt.subplots(2, 2, figsize=(10, 6.4), dpi=80)
    queries = rate("prefix_cache_queries_tokens_total")
    for tier in ("device", "host", "storage"):
        hits = rate("cached_tokens_total", tier=tier)
        ax[0, 0].plot(t, [h / q if q else 0 for h, q in zip(hits, queries)], label=tier)
    ax[0, 0].set_title("Prefix cache hit rate, by tier")
    for name, label in (("prefetch_pages_total", "prefetch"), ("backup_pages_total", "backup"),
                        ("handoff_pages_total", "handoff"), ("offload_pages_total", "offload")):
        ax[0, 1].plot(t, rate(name), label=label)
    ax[0, 1].set_title("Pages moved per second")
    for name, label in (("inter_token_seconds", "inter-token"), ("ttft_seconds", "TTFT"),
                        ("e2e_seconds", "E2E")):
        ax[1, 0].plot(t, [quantile(0.5, a, b, name) * 1e3 for (_, a), (_, b) in pairs],
                      label=f"{label} p50")
    ax[1, 0].set_title("Latency (ms)")
    ax[1, 0].set_yscale("log")
    for tier in ("device", "host"):
        ax[1, 1].plot(t, [total(b, "pool_used_pages", tier=tier) /
                          max(total(b, "pool_capacity_pages", tier=tier), 1)
                          for _, b in shots[1:]], label=tier)
    ax[1, 1].set_title("Pool usage")
    for a in ax.flat:
        a.legend(fontsize=8)
        a.set_xlabel("s", fontsize=8)
        a.tick_params(labelsize=8)
    fig.suptitle("pd-cache: PDCluster, 4 tenants, turns alternating prefill workers")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/metrics.png"))
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    port = free_port()
    shots = [(0.0, {})] + run(args.rounds, port)
    plot(shots, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
