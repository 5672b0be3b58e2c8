"""Request records and summaries of small bench runs, with numbers chosen to be checked by
hand: one run's records (completions over two turns, a timeout, a server error) and the
summaries of a sweep's points.
"""

from __future__ import annotations

from pd_cache.app.bench.records import RequestRecord
from pd_cache.app.bench.summary import SLO, summarize


def rec(index: int, turn: int, sent_s: float, **kw) -> RequestRecord:
    return RequestRecord(index=index, rid=f"bench-{index}", tenant=index % 2,
                         session=f"s{index % 2}", turn=turn, scheduled_s=sent_s,
                         sent_s=sent_s, **kw)


def run_records() -> list[RequestRecord]:
    """Three completions over turns 0 and 1, a timeout and a server error."""
    return [
        rec(0, 0, 0.1, first_token_s=0.2, end_s=0.6, ttft_ms=100.0, itl_ms=[10.0, 20.0],
            e2el_ms=130.0, prompt_tokens=100, output_tokens=3, cached_tokens=0,
            expected_cached_tokens=0),
        rec(1, 1, 1.2, first_token_s=1.24, end_s=1.5, ttft_ms=40.0, itl_ms=[5.0],
            e2el_ms=45.0, prompt_tokens=200, output_tokens=2, cached_tokens=150,
            expected_cached_tokens=160, tier_hits={"host": 100, "storage": 50},
            cross_namespace_tokens=0),
        rec(2, 1, 1.3, first_token_s=1.36, end_s=2.4, ttft_ms=60.0, itl_ms=[10.0] * 3,
            e2el_ms=90.0, prompt_tokens=200, output_tokens=4, cached_tokens=100,
            expected_cached_tokens=160),
        rec(3, 0, 2.0, prompt_tokens=50, error="TimeoutError: no answer in 30 s",
            error_type="TimeoutError"),
        rec(4, 1, 2.5, end_s=2.7, prompt_tokens=300, error="HTTPError: 500",
            error_type="HTTPError"),
    ]


ORACLE = {"ideal_hit_rate": 0.7, "lru_hit_rate": 0.6}
CONFIG = {"target": "local", "workload": "chat", "rate": 2.0, "seed": 0, "cache": True}


def run_summary(**kw) -> dict:
    args = {"duration_s": 3.0, "slo": SLO(ttft_ms=80.0), "server_delta": None,
            "oracle": ORACLE, "config": CONFIG} | kw
    return summarize(run_records(), **args)


def sweep_summary(rate, cache, ttft_scale: float) -> dict:
    records = [rec(i, 0, 0.1 * i, end_s=0.5, ttft_ms=ttft_scale * (i + 1), e2el_ms=100.0,
                   prompt_tokens=10, output_tokens=2, cached_tokens=5 if cache else 0)
               for i in range(4)]
    config = {"rate": rate} if cache is None else {"rate": rate, "cache": cache}
    return summarize(records, duration_s=1.0, config=config)
