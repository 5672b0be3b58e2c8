"""Arrival processes: rate and burstiness of the gaps for a fixed seed; parameter errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pd_cache.app.bench.arrivals import arrival_times, parse_rates


def gaps_cv(times: np.ndarray) -> tuple[float, float]:
    """(mean rate, coefficient of variation of the gaps)."""
    gaps = np.diff(times)
    return 1.0 / gaps.mean(), gaps.std() / gaps.mean()


def test_poisson_has_the_asked_rate_and_cv_one() -> None:
    times = arrival_times(20_000, 10.0, seed=0)
    rate, cv = gaps_cv(times)
    assert times[0] == 0.0 and len(times) == 20_000 and times.dtype == np.float64
    assert np.all(np.diff(times) >= 0)
    assert rate == pytest.approx(10.0, rel=0.02)
    assert cv == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_cv_is_one_over_sqrt_burstiness(burstiness: float) -> None:
    times = arrival_times(20_000, 10.0, process="gamma", burstiness=burstiness, seed=1)
    rate, cv = gaps_cv(times)
    assert rate == pytest.approx(10.0, rel=0.03)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_constant_gaps_are_exact() -> None:
    times = arrival_times(5, 4.0, process="constant")
    assert times.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert gaps_cv(arrival_times(1000, 3.0, process="constant"))[1] == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("process", ["poisson", "gamma", "constant"])
def test_infinite_rate_sends_everything_at_zero(process: str) -> None:
    assert arrival_times(7, math.inf, process=process).tolist() == [0.0] * 7


def test_same_seed_same_times_and_empty_stream() -> None:
    assert np.array_equal(arrival_times(50, 2.0, seed=3), arrival_times(50, 2.0, seed=3))
    assert not np.array_equal(arrival_times(50, 2.0, seed=3), arrival_times(50, 2.0, seed=4))
    assert arrival_times(0, 2.0).shape == (0,)
    assert arrival_times(1, 2.0).tolist() == [0.0]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n": -1}, "n"), ({"n": 2.0}, "n"), ({"rate": 0}, "rate"), ({"rate": -1.0}, "rate"),
    ({"rate": math.nan}, "rate"), ({"process": "uniform"}, "process"),
    ({"burstiness": 0}, "burstiness"), ({"process": "gamma", "burstiness": -2}, "burstiness"),
])
def test_bad_parameters_are_named(kwargs: dict, field: str) -> None:
    args = {"n": 10, "rate": 1.0} | kwargs
    n, rate = args.pop("n"), args.pop("rate")
    with pytest.raises(ValueError, match=f"^{field}: "):
        arrival_times(n, rate, **args)


def test_parse_rates() -> None:
    assert parse_rates("4") == [4.0]
    assert parse_rates("1, 2,4,8") == [1.0, 2.0, 4.0, 8.0]
    assert parse_rates("0.5,inf") == [0.5, math.inf]


@pytest.mark.parametrize(("text", "item"), [
    ("1,x,4", "'x'"), ("2,0", "'0'"), ("-1", "'-1'"), ("1,,2", "''"), ("nan", "'nan'"),
])
def test_parse_rates_names_the_bad_item(text: str, item: str) -> None:
    with pytest.raises(ValueError, match=f"rates: {item} in"):
        parse_rates(text)
    with pytest.raises(ValueError, match="rates: "):
        parse_rates("")
