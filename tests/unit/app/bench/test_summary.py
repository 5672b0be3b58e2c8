"""summary.json numbers against small cases computed by hand, and the files of a run."""

from __future__ import annotations

import json
import math
import re

import pytest

from pd_cache.app.bench.records import read_lines
from pd_cache.app.bench.summary import (
    SCHEMA_VERSION,
    SLO,
    format_sweep,
    format_table,
    latency_stats,
    summarize,
    write_run,
)
from tests.unit.app.bench.runs import CONFIG, ORACLE, rec, run_records, run_summary, sweep_summary


def test_latency_stats_of_a_known_list():
    s = latency_stats(range(1, 11))
    assert s["mean"] == 5.5 and s["median"] == 5.5 and s["max"] == 10.0
    assert s["std"] == pytest.approx(math.sqrt(8.25))
    # linear interpolation between order statistics: rank (n - 1) * q
    assert (s["p90"], s["p95"], s["p99"]) == pytest.approx((9.1, 9.55, 9.91))
    assert latency_stats([]) == dict.fromkeys(("mean", "median", "std", "p90", "p95", "p99",
                                               "max"))
    with pytest.raises(ValueError, match="finite"):
        latency_stats([1.0, float("nan")])


def test_tpot_is_time_after_the_first_token_per_later_token():
    assert rec(0, 0, 0.0, ttft_ms=10.0, e2el_ms=100.0, output_tokens=10).tpot_ms == 10.0
    assert rec(0, 0, 0.0, ttft_ms=10.0, e2el_ms=100.0, output_tokens=1).tpot_ms is None
    assert rec(0, 0, 0.0, output_tokens=5, error="X: y").tpot_ms is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "100"])
def test_slo_refuses_bounds_that_are_not_positive_numbers(bad):
    with pytest.raises(ValueError, match="ttft_ms"):
        SLO(ttft_ms=bad)


def test_slo_admits_completed_requests_within_every_bound():
    fast, slow, failed, *_ = run_records()[1], run_records()[0], run_records()[3]
    assert SLO().admits(slow) and not SLO().admits(failed)
    assert SLO(ttft_ms=80).admits(fast) and not SLO(ttft_ms=80).admits(slow)
    assert SLO(tpot_ms=10).admits(fast) and not SLO(tpot_ms=10).admits(slow)  # 5 vs 15 ms
    assert not SLO(e2el_ms=44).admits(fast)
    # one output token: no TPOT to miss; unknown TTFT misses a TTFT bound
    one = rec(9, 0, 0.0, ttft_ms=5.0, e2el_ms=5.0, output_tokens=1)
    assert SLO(tpot_ms=1).admits(one)
    assert not SLO(ttft_ms=1000).admits(rec(9, 0, 0.0, e2el_ms=5.0, output_tokens=1))


def test_requests_throughput_and_goodput():
    res = run_summary()["results"]
    assert res["requests"] == {"total": 5, "completed": 3, "failed": 2, "good": 2,
                               "errors_by_type": {"HTTPError": 1, "TimeoutError": 1}}
    t = res["throughput"]
    assert t["request_throughput"] == pytest.approx(1.0)
    assert t["request_goodput"] == pytest.approx(2 / 3)   # request 0: TTFT 100 > 80 ms
    assert t["input_tok_s"] == pytest.approx(500 / 3)      # completed requests only
    assert t["output_tok_s"] == pytest.approx(3.0)
    assert res["slo"] == {"ttft_ms": 80.0, "tpot_ms": None, "e2el_ms": None}
    assert summarize(run_records(), duration_s=3.0)["results"]["requests"]["good"] == 3


def test_latencies_count_completed_requests():
    lat = run_summary()["results"]["latency_ms"]
    assert lat["ttft"] == latency_stats([100.0, 40.0, 60.0])
    assert lat["tpot"] == latency_stats([15.0, 5.0, 10.0])
    assert lat["itl"] == latency_stats([10.0, 20.0, 5.0, 10.0, 10.0, 10.0])
    assert lat["e2el"]["max"] == 130.0


def test_cache_blocks():
    cache = run_summary(server_delta={"prefix_cache": {"hit_tokens": 7}})["results"]["cache"]
    assert cache["client"] == {"requests": 3, "prompt_tokens": 500, "cached_tokens": 250,
                               "hit_rate": 0.5, "tier_hits": {"host": 100, "storage": 50}}
    assert cache["expected"]["hit_rate"] == pytest.approx(320 / 500)
    assert cache["oracle"] == ORACLE
    assert cache["server_delta"] == {"prefix_cache": {"hit_tokens": 7}}
    assert cache["isolation"] == {"cross_tenant_hit_tokens": 0}


def test_cache_blocks_when_the_server_says_nothing():
    quiet = [rec(0, 0, 0.0, ttft_ms=1.0, e2el_ms=2.0, prompt_tokens=10, output_tokens=2)]
    cache = summarize(quiet, duration_s=1.0)["results"]["cache"]
    assert cache["client"]["hit_rate"] is None and cache["client"]["tier_hits"] is None
    assert cache["expected"]["hit_rate"] is None
    assert cache["isolation"]["cross_tenant_hit_tokens"] is None
    assert cache["oracle"] is None and cache["server_delta"] is None


def test_per_turn():
    rows = run_summary()["results"]["per_turn"]
    assert rows == [
        {"turn": 0, "requests": 2, "completed": 1, "ttft_ms_mean": 100.0, "ttft_ms_p50": 100.0,
         "hit_rate": 0.0, "expected_hit_rate": 0.0},
        {"turn": 1, "requests": 3, "completed": 2, "ttft_ms_mean": 50.0, "ttft_ms_p50": 50.0,
         "hit_rate": 250 / 400, "expected_hit_rate": 320 / 400},
    ]


def test_time_series_buckets_by_end_time():
    rows = run_summary()["results"]["time_series"]
    assert rows == [
        {"t_s": 0.0, "sent": 1, "completed": 1, "output_tokens": 3, "errors": 0,
         "ttft_ms_p50": 100.0},
        {"t_s": 1.0, "sent": 2, "completed": 1, "output_tokens": 2, "errors": 0,
         "ttft_ms_p50": 40.0},
        # request 2 ends at 2.4 s; the timeout has no end and counts at its send (2.0 s)
        {"t_s": 2.0, "sent": 2, "completed": 1, "output_tokens": 4, "errors": 2,
         "ttft_ms_p50": 60.0},
    ]
    longer = summarize(run_records(), duration_s=4.5)["results"]["time_series"]
    assert len(longer) == 5 and longer[-1]["completed"] == 0


def test_flat_has_vllm_keys_equal_to_results():
    doc = run_summary()
    flat, res = doc["flat"], doc["results"]
    lat, tput = res["latency_ms"], res["throughput"]
    assert flat["mean_ttft_ms"] == lat["ttft"]["mean"]
    assert flat["median_ttft_ms"] == lat["ttft"]["median"] == 60.0
    assert flat["p99_ttft_ms"] == lat["ttft"]["p99"]
    assert flat["mean_tpot_ms"] == lat["tpot"]["mean"] == 10.0
    assert flat["median_tpot_ms"] == lat["tpot"]["median"]
    assert flat["p99_tpot_ms"] == lat["tpot"]["p99"]
    assert flat["median_itl_ms"] == lat["itl"]["median"] == 10.0
    assert flat["p99_itl_ms"] == lat["itl"]["p99"]
    assert flat["mean_e2el_ms"] == lat["e2el"]["mean"]
    assert flat["request_goodput"] == tput["request_goodput"]
    assert flat["request_throughput"] == tput["request_throughput"]
    assert flat["output_throughput"] == tput["output_tok_s"]
    assert (flat["completed"], flat["total_input_tokens"], flat["total_output_tokens"]) == (
        3, 500, 9)
    assert flat["request_rate"] == 2.0
    assert flat["client_hit_rate"] == 0.5 and flat["oracle_ideal_hit_rate"] == 0.7
    assert doc["schema_version"] == SCHEMA_VERSION and doc["config"] == CONFIG


def test_no_records_and_bad_durations():
    doc = summarize([], duration_s=2.0)
    assert doc["results"]["requests"]["total"] == 0
    assert doc["flat"]["mean_ttft_ms"] is None and len(doc["results"]["time_series"]) == 2
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="duration_s"):
            summarize([], duration_s=bad)


def test_an_error_without_a_type_counts_as_unknown():
    doc = summarize([rec(0, 0, 0.0, error="boom")], duration_s=1.0)
    assert doc["results"]["requests"]["errors_by_type"] == {"unknown": 1}


def test_write_run_and_read_it_back(tmp_path):
    records = run_records()
    doc = run_summary()
    files = write_run(tmp_path / "runs" / "one", records, doc)
    lines = files.requests.read_text().splitlines()
    assert len(lines) == len(records)
    assert "output_ids" not in json.loads(lines[0]) and "tpot_ms" not in json.loads(lines[0])
    assert read_lines(files.requests) == records
    back = json.loads(files.summary.read_text())
    assert back["schema_version"] == SCHEMA_VERSION
    assert back == json.loads(json.dumps(doc))
    assert files.summary.read_text().startswith('{\n  "')   # indented


def test_read_lines_names_the_bad_line(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"index": 0}\n')
    with pytest.raises(ValueError, match="requests.jsonl:1"):
        read_lines(path)


def test_format_table():
    delta = {"prefix_cache": {"queried_tokens": 400, "hit_tokens": 250, "hit_rate": 0.625},
             "cached_tokens_by_tier": {"device": 0, "host": 200, "storage": 50},
             "handoff_pages": 20, "handoff_kept_pages": 60,
             "decode_cache_hits_by_tier": {"device": 50, "host": 4, "storage": 6}}
    text = format_table(run_summary(server_delta=delta))
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1   # aligned: values end in one column
    row = dict(re.split(r"\s{2,}", line.strip()) for line in lines)
    assert row["requests ok / failed / good"] == "3 / 2 / 2"
    assert row["errors: TimeoutError"] == "1"
    assert row["goodput (TTFT<=80ms)"] == "0.67 req/s"
    assert row["hit rate: client"] == "50.0% (250/500 tok)"
    assert row["hit rate: oracle ideal / LRU"] == "70.0% / 60.0%"
    assert row["server: cached tokens, host"] == "200"
    assert row["server: pages handed off P->D"] == "20 (25.0% of the prompts' pages)"
    assert row["server: pages kept on decode"] == "60 (device 50, host 4, storage 6)"
    assert row["cross-tenant hit tokens"] == "0"
    assert "TTFT p50 / p90 / p99" in text and "ITL p99" in text
    assert "server:" not in format_table(run_summary())


def test_format_sweep_labelled():
    sweep = [sweep_summary(r, c, 10.0 if c else 20.0) for r in (4.0, 1.0, "inf")
             for c in (True, False)]
    lines = format_sweep(sweep).splitlines()
    assert "cache=on" in lines[0] and "cache=off" in lines[0]
    assert lines[1].split()[0] == "rate" and lines[1].split()[-1] == "off/on"
    assert [line.split()[0] for line in lines[2:]] == ["1", "4", "inf"]
    assert lines[2].split()[-1] == "2.00x"
    assert "50.0%" in lines[2] and "0.0%" in lines[2]


def test_format_sweep_unlabelled_and_errors():
    lines = format_sweep([sweep_summary(2, None, 1.0), sweep_summary(1, None, 1.0)]).splitlines()
    assert lines[0].split()[0] == "rate" and len(lines) == 3
    assert "cache=" not in lines[0] and "x" not in lines[1]
    with pytest.raises(ValueError, match="no config"):
        format_sweep([summarize([], duration_s=1.0)])
    with pytest.raises(ValueError, match="twice"):
        format_sweep([sweep_summary(1, True, 1.0), sweep_summary(1.0, True, 1.0)])
