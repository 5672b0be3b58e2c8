"""Token-length distributions of generated workloads, and their command-line form::

    "128"                  Fixed(128)
    "uniform:64:256"       Uniform(64, 256)      each integer in [64, 256] equally likely
    "lognormal:256:0.5"    LogNormal(256, 0.5)   median 256, sigma 0.5 of the log

Every sample is an int >= 1.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class LengthDist(ABC):
    """A distribution of token counts."""

    @abstractmethod
    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` lengths drawn with ``rng``, each an int >= 1."""


@dataclass(frozen=True)
class Fixed(LengthDist):
    length: int

    def __post_init__(self) -> None:
        _check_int("length", self.length)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [self.length] * n

    def __str__(self) -> str:
        return str(self.length)


@dataclass(frozen=True)
class Uniform(LengthDist):
    """Each integer in ``[low, high]`` (both included) equally likely."""

    low: int
    high: int

    def __post_init__(self) -> None:
        _check_int("low", self.low)
        _check_int("high", self.high)
        if self.high < self.low:
            raise ValueError(f"high: expected >= low={self.low}, got {self.high}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high, n, endpoint=True).tolist()

    def __str__(self) -> str:
        return f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """``median * exp(sigma * N(0, 1))``, rounded, at least 1.

    ``median`` is the median (the mean is ``median * exp(sigma**2 / 2)``): a long tail of
    long requests around a typical length, as in chat traces.
    """

    median: float
    sigma: float

    def __post_init__(self) -> None:
        for name in ("median", "sigma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < math.inf:
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        draws = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.maximum(np.rint(draws), 1).astype(np.int64).tolist()

    def __str__(self) -> str:
        return f"lognormal:{self.median:g}:{self.sigma:g}"


def _check_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: expected an int >= 1, got {value!r}")


def as_length(field: str, value: int | LengthDist) -> LengthDist:
    """``value`` as a distribution: an int is ``Fixed``. ``ValueError`` naming ``field``."""
    if isinstance(value, LengthDist):
        return value
    try:
        return Fixed(value)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"{field}: expected an int >= 1 or a LengthDist, got "
                         f"{value!r}") from None


def parse_length(text: str, field: str = "length") -> LengthDist:
    """``"128"``, ``"fixed:128"``, ``"uniform:LO:HI"`` or ``"lognormal:MEDIAN:SIGMA"``.

    Raises ``ValueError`` naming ``field`` (the flag) and the text.
    """
    parts = text.strip().split(":") if isinstance(text, str) else []
    kind, args = (parts[0].lower(), parts[1:]) if len(parts) > 1 else ("fixed", parts)
    shapes = {"fixed": (Fixed, int, 1), "uniform": (Uniform, int, 2),
              "lognormal": (LogNormal, float, 2)}
    try:
        cls, convert, arity = shapes[kind]
        if len(args) != arity:
            raise ValueError(f"expected {arity} number(s) after {kind!r}")
        return cls(*(convert(a) for a in args))
    except (KeyError, ValueError) as exc:
        why = f"unknown kind {kind!r}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{field}: {text!r}: {why}; expected N, uniform:LO:HI or "
                         f"lognormal:MEDIAN:SIGMA") from None
