"""Mooncake trace replay: shared hash ids become shared token blocks, lengths scale, bad
lines are named; ``make_trace`` writes what ``trace_workload`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pd_cache.app.bench.oracle import OracleRequest, simulate
from pd_cache.app.bench.traces import make_trace, trace_workload
from pd_cache.app.bench.workloads import Workload

SHIPPED = Path(__file__).parents[4] / "benchmarks" / "traces" / "mooncake_small.jsonl"


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row(ts: int, n: int, out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def load(path: Path, **kwargs) -> Workload:
    return trace_workload(path, **({"block_tokens": 8, "max_output_tokens": 100} | kwargs))


def test_shared_leading_hash_ids_share_exactly_those_blocks(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [
        row(1000, 3 * 512, 10, [1, 2, 3]),
        row(1500, 3 * 512, 500, [1, 2, 4]),
        row(4000, 2 * 512, 0, [5, 2]),
    ])
    w = load(path, time_scale=2.0)
    a, b, c = (r.prompt_ids({}) for r in w.requests)
    assert len(a) == len(b) == 24 and len(c) == 16
    assert a[:16] == b[:16] and a[16:] != b[16:]
    assert a[:8] != c[:8] and a[8:16] == c[8:16]   # same id, same block, wherever it is
    assert [r.offset_s for r in w.requests] == [0.0, 0.25, 1.5]
    assert [r.max_tokens for r in w.requests] == [10, 100, 1]
    assert all(r.depends_on is None and r.turn == 0 for r in w.requests)
    assert load(path).requests[2].prompt_ids({}) == c   # deterministic from seed and id
    assert load(path, seed=1).requests[2].prompt_ids({}) != c


def test_lengths_scale_by_block_tokens_over_source_block(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [
        row(0, 1000, 1, [1, 2]),       # 1000 * 8 / 512 = 15.6  -> 16 tokens: both blocks
        row(0, 700, 1, [1, 2]),        # 10.9 -> 11: block 1, 3 tokens of block 2
        row(0, 1568, 1, [1, 2]),       # 24.5 -> 25 (half up): 9 tokens past the blocks
        row(0, 10, 1, [1]),            # 0.16 -> at least 1
    ])
    full, cut, padded, tiny = (r.prompt_ids({}) for r in load(path).requests)
    assert [len(p) for p in (full, cut, padded, tiny)] == [16, 11, 25, 1]
    assert cut == full[:11] and padded[:16] == full and tiny == full[:1]


def test_requests_are_sorted_by_timestamp_and_limited(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(500, 512, 3, [1]), row(100, 512, 4, [2]),
                                        row(300, 512, 5, [3])])
    w = load(path)
    assert [r.max_tokens for r in w.requests] == [4, 5, 3]
    assert [r.offset_s for r in w.requests] == [0.0, 0.2, 0.4]
    assert [r.index for r in w.requests] == [0, 1, 2]
    assert [r.max_tokens for r in load(path, limit=2).requests] == [4, 3]


def test_tenants_follow_the_first_hash_id(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(0, 512, 1, [4, 9]), row(1, 512, 1, [7]),
                                        row(2, 512, 1, [4, 1]), row(3, 0, 1, [])])
    w = load(path, tenants=3)
    assert [r.tenant for r in w.requests] == [1, 1, 1, 1]   # 4 % 3, 7 % 3, 4 % 3, line 4 % 3
    assert [r.cache_salt for r in w.requests] == ["tenant-1"] * 4
    assert w.requests[0].extra_key == "adapter-1"
    assert [r.tenant for r in load(path, tenants=2).requests] == [0, 1, 0, 0]


@pytest.mark.parametrize(("text", "field"), [
    ('{"timestamp": 1, "output_length": 1, "hash_ids": []}', "input_length: missing"),
    ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}',
     "timestamp: expected an int >= 0"),
    ('{"timestamp": 1, "input_length": 1.5, "output_length": 1, "hash_ids": []}',
     "input_length: expected an int >= 0"),
    ('{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, "x"]}',
     "hash_ids: expected a list of ints"),
    ("{not json", "not a JSON object"),
    ("[1, 2]", "expected a JSON object, got list"),
])
def test_a_bad_line_is_named(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, 512, 1, [1])) + "\n\n" + text + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:3: {field}"):
        load(path)


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(0, 512, 1, [1])])
    for kwargs, field in [({"block_tokens": 0}, "block_tokens"), ({"time_scale": 0},
                          "time_scale"), ({"max_output_tokens": 0}, "max_output_tokens"),
                          ({"tenants": 0}, "tenants"), ({"limit": -1}, "limit")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            load(path, **kwargs)


def test_make_trace_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "synthetic.jsonl"
    assert make_trace(path, num_requests=120, seed=4, rate=5.0) == 120
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 120 and rows[0]["timestamp"] == 0
    assert all(a["timestamp"] <= b["timestamp"] for a, b in zip(rows, rows[1:]))
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    w = trace_workload(path, block_tokens=16, max_output_tokens=64)
    assert len(w.requests) == 120
    for r, raw in zip(w.requests, rows):
        assert len(r.prompt_ids({})) == (2 * raw["input_length"] * 16 + 512) // 1024
        assert r.offset_s == pytest.approx(raw["timestamp"] / 1000)
    # popular system prompts and growing chats: many prompts share leading blocks
    ran = [OracleRequest(r.index, r.cache_salt, r.extra_key, r.prompt_ids({}), [],
                         r.offset_s, None) for r in w.requests]
    assert simulate(ran, page_size=16).ideal_hit_rate > 0.3
    assert make_trace(tmp_path / "again.jsonl", num_requests=120, seed=4,
                      rate=5.0) == 120
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()


def test_the_shipped_trace_loads() -> None:
    w = trace_workload(SHIPPED, block_tokens=16, max_output_tokens=128)
    assert len(w.requests) == 200
