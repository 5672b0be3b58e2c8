"""The serving overhead: TTFT through ``pd-cache serve`` at low load (one request at a time)
minus the in-process compute of the same request, split by hop.

The floor is bench_engine's idea for a cold prompt: pd-cache's own model forward over the
prompt and the greedy pick of the first token, in this process, on one thread (each worker
runs with OMP_NUM_THREADS=1), nothing else; the fastest of its runs (the least disturbed on
a shared machine), taken before the servers start. The hops come from clock reads on one machine:
the client's ``time.time_ns()`` when it sends and when the first token arrives, and the
ingress's (``received_ns``, ``first_token_ns``) and the cluster's (``ttft_ms``, the prefill
worker's own ``prefill_ms``) that pd-cache shows an admin key in the stream's last chunk::

    proxy in        received_ns - sent            client -> Serve proxy -> ingress replica
    ingress         first_token_ns - received_ns - ttft_ms   parse, tokenize, admit, SSE
    router + call   ttft_ms - prefill_ms          page names, routing, the Ray call there
                                                  and back
    worker          prefill_ms - floor            match, pages, insert, sampling
    first token back  client first token - first_token_ns   ingress -> proxy -> client
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import time
from typing import Any

from pd_cache.app.bench.targets import ids_to_text

HOPS = ("proxy_in_ms", "ingress_ms", "router_and_call_ms", "worker_ms", "first_token_back_ms")


def floor_ms(model_dir: str, tokens: int, repeats: int = 15) -> dict[str, float]:
    """Median and minimum of pd-cache's model forward over ``tokens`` tokens + argmax."""
    import torch

    from pd_cache.core.model_config import ModelConfig
    from pd_cache.model.hf_model import build_model

    torch.set_num_threads(1)
    model = build_model(ModelConfig.from_pretrained(model_dir))
    ids = [random.Random(0).randrange(3, 200) for _ in range(tokens)]
    times = []
    with torch.no_grad():
        for i in range(repeats + 2):
            start = time.perf_counter()
            out = model(ids)
            int(torch.argmax(out.logits[-1]))
            if i >= 2:   # two warm-ups: allocator, kernels
                times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "tokens": tokens}


def one(url: str, model: str, prompt: str) -> dict[str, float]:
    """One streamed request; its client TTFT and the server's stamps (ns / ms)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}})
    sent = time.time_ns()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, details = None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if first is None and any(c.get("token_ids") or c.get("text")
                                 for c in event.get("choices") or []):
            first = time.time_ns()
        details = event.get("pd_cache") or details
    conn.close()
    if first is None or not details or "received_ns" not in details:
        raise RuntimeError(f"no first token or no pd_cache stamps from {url} (open mode or "
                           "an admin key is needed)")
    return {"sent": sent, "first": first, **details}


def hops(url: str, model: str, tokens: int, requests: int) -> list[dict[str, float]]:
    """``requests`` requests one at a time, each a fresh prompt of ``tokens`` tokens."""
    rng = random.Random(7)
    out = []
    for _ in range(requests + 2):
        stamp = one(url, model, ids_to_text([rng.randrange(95) for _ in range(tokens)]))
        out.append(stamp)
    return out[2:]


def _ingress_parts(s: dict[str, float]) -> dict[str, float]:
    """Two parts of the ingress hop, from servers that stamp them: the body's fetch (from
    Serve's proxy; local with direct ingress) and its parse, tokenize and admission."""
    if "body_ns" not in s:
        return {}
    return {"ingress_body_ms": (s["body_ns"] - s["received_ns"]) / 1e6,
            "ingress_parse_admit_ms": (s["admitted_ns"] - s["body_ns"]) / 1e6}


def breakdown(stamps: list[dict[str, float]], floor: float) -> dict[str, Any]:
    """Median TTFT, the overhead over ``floor`` and the median of each hop (ms)."""
    rows = []
    for s in stamps:
        ttft = (s["first"] - s["sent"]) / 1e6
        ingress_total = (s["first_token_ns"] - s["received_ns"]) / 1e6
        rows.append({"ttft_ms": ttft,
                     "proxy_in_ms": (s["received_ns"] - s["sent"]) / 1e6,
                     "ingress_ms": ingress_total - s["ttft_ms"],
                     "router_and_call_ms": s["ttft_ms"] - s["prefill_ms"],
                     "worker_ms": s["prefill_ms"] - floor,
                     "prefill_worker_total_ms": s["prefill_ms"],
                     "first_token_back_ms": (s["first"] - s["first_token_ns"]) / 1e6,
                     **_ingress_parts(s)})
    med = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    return {"ttft_p50_ms": med.pop("ttft_ms"), "floor_ms": round(floor, 2),
            "serving_overhead_ms": round(statistics.median(r["ttft_ms"] for r in rows)
                                         - floor, 2),
            "hops_p50_ms": med, "requests": len(rows),
            "hops_outside_worker_p50_ms": round(statistics.median(
                r["proxy_in_ms"] + r["ingress_ms"] + r["router_and_call_ms"]
                + r["first_token_back_ms"] for r in rows), 2)}
