"""Open-loop arrival times: when each request is sent, independent of the responses.

Gaps between arrivals are drawn from one process at a mean ``rate`` (requests/s); the
first request arrives at 0::

    poisson    exponential gaps, mean 1/rate                       (CV 1)
    gamma      gamma gaps, shape=burstiness, scale=1/(rate*burstiness)  (CV 1/sqrt(burstiness))
    constant   every gap exactly 1/rate                            (CV 0)

``burstiness < 1`` makes gamma arrivals come in bursts, ``= 1`` is Poisson, ``> 1`` is
smoother. ``rate = inf`` sends everything at 0.
"""

from __future__ import annotations

import math

import numpy as np

PROCESSES = ("poisson", "gamma", "constant")


def arrival_times(n: int, rate: float, *, process: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """``n`` non-decreasing float64 send times in seconds from 0 (the first is 0).

    Raises ``ValueError`` naming the parameter for ``n < 0``, ``rate <= 0`` (or NaN), an
    unknown ``process`` or ``burstiness <= 0``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    _check_positive("rate", rate)
    if process not in PROCESSES:
        raise ValueError(f"process: expected one of {list(PROCESSES)}, got {process!r}")
    _check_positive("burstiness", burstiness)
    if n == 0 or math.isinf(rate):
        return np.zeros(n, dtype=np.float64)
    gaps = _gaps(np.random.default_rng(seed), n - 1, float(rate), process, float(burstiness))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _gaps(rng: np.random.Generator, k: int, rate: float, process: str,
          burstiness: float) -> np.ndarray:
    if process == "poisson":
        return rng.exponential(1.0 / rate, k)
    if process == "gamma":
        return rng.gamma(burstiness, 1.0 / (rate * burstiness), k)
    return np.full(k, 1.0 / rate)


def _check_positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field}: expected a number > 0, got {value!r}")


def parse_rates(text: str) -> list[float]:
    """Request rates from the command line: ``"4"``, ``"1,2,4,8"``, ``"inf"``.

    Each comma-separated item is a number > 0 or ``inf`` (``math.inf``: all at once).
    Raises ``ValueError`` naming the bad item.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"rates: expected comma-separated numbers > 0 or 'inf', got {text!r}")
    rates = []
    for item in text.split(","):
        try:
            rate = float(item.strip())
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise ValueError(f"rates: {item.strip()!r} in {text!r} is not a number > 0 "
                             f"or 'inf'")
        rates.append(rate)
    return rates
