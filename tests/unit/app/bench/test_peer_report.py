"""The peer benchmark's report (``benchmarks/peers/report.py``): goodput is the best of a
server over the whole grid, its last rate (``inf``: every request at once) included; the
headline ratios are pd-cache over the peer; ``inf`` is drawn right of the finite rates."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from typing import Any

import pytest

PEERS = Path(__file__).parents[4] / "benchmarks" / "peers"


@pytest.fixture(scope="module")
def peers() -> Any:
    sys.path.insert(0, str(PEERS))   # NOTE: the runner's folder, its modules by bare name
    try:
        yield importlib.import_module("report"), importlib.import_module("points")
    finally:
        sys.path.remove(str(PEERS))


def server(ttft: float, goodput: float, tok_s: float) -> dict[str, Any]:
    return {"ttft_p50_ms": ttft, "goodput_rps": goodput, "output_tok_s": tok_s}


def grid() -> dict[str, Any]:
    """Points as ``report.build`` keys them, in the grid's order (rates rising, inf last)."""
    return {
        "compute/multi-turn/0.25": {"pd": server(58, 0.22, 7), "peer": server(53, 0.22, 7)},
        "compute/multi-turn/4": {"pd": server(72, 3.84, 123), "peer": server(194, 2.68, 86)},
        "compute/multi-turn/inf": {"pd": server(312, 7.51, 240), "peer": server(523, 0.86, 49)},
        "compute/zero-reuse/4": {"pd": server(313, 3.33, 107), "peer": server(917, 1.23, 57)},
        "compute/zero-reuse/inf": {"pd": server(1790, 3.08, 143),
                                   "peer": server(6296, 0.0, 47)},
    }


def test_the_grid_ends_with_every_request_at_once(peers) -> None:
    _, points = peers
    assert points.RATES[-1] == math.inf
    assert list(points.RATES[:-1]) == sorted(points.RATES[:-1])
    point = points.Point("compute", "multi-turn", math.inf, 16)
    assert point.key == "compute/multi-turn/inf"
    command = points.bench_command(point, "http://127.0.0.1:1", Path("out"), 7)
    assert command[command.index("--request-rate") + 1] == "inf"


def test_goodput_is_each_servers_best_over_the_grid_inf_included(peers) -> None:
    report, _ = peers
    best = report.goodput(grid())
    # pd-cache's best is all at once, the peer's at 4 req/s: each server its own best
    assert best["compute/multi-turn"] == {"pd": 7.51, "peer": 2.68}
    assert best["compute/zero-reuse"] == {"pd": 3.33, "peer": 1.23}


def test_headline_ratios_are_pd_cache_over_the_peer(peers) -> None:
    report, _ = peers
    points = grid()
    out = report.ratios({"points": points, "goodput": report.goodput(points)})
    assert out["goodput_ratio"] == round(7.51 / 2.68, 3)
    assert out["ttft_p50_ratio"] == round(58 / 53, 3)   # the lowest rate, not inf
    assert out["zero_reuse_throughput_ratio"] == round(143 / 57, 3)   # best tok/s of each
    assert out["serving_overhead_ms"] is None


def test_inf_is_drawn_right_of_every_finite_rate(peers, tmp_path: Path) -> None:
    report, _ = peers
    assert report.drawn_at(2.0, [0.25, 4.0, math.inf]) == 2.0
    assert report.drawn_at(math.inf, [0.25, 4.0, math.inf]) == 8.0
    assert report.drawn_at(math.inf, [math.inf]) == 8.0   # no finite rate: as if 4 req/s
    pytest.importorskip("matplotlib")
    result = {"points": grid(), "peer": "transformers",
              "machine": {"load_avg_before": [0.5, 0.5, 0.5]}}
    report.plot(result, tmp_path / "peers.png")
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
