"""The ingress gives a burst's freed heap back once it is quiet, and only then."""

from __future__ import annotations

import asyncio

from pd_cache.front.memory import IdleTrim, malloc_trim

DELAY_S = 0.02


def _run(trim: IdleTrim, waves: list[int], gap_s: float = 0.0) -> None:
    """``waves[i]`` requests at once, each wave answered whole, ``gap_s`` apart; then quiet."""
    async def go() -> None:
        for n in waves:
            for _ in range(n):
                trim.enter()
            for _ in range(n):
                trim.leave()
            await asyncio.sleep(gap_s)
        await asyncio.sleep(DELAY_S * 5)
    asyncio.run(go())


def _counted(after_peak: int = 4) -> tuple[IdleTrim, list[int]]:
    calls: list[int] = []
    return IdleTrim(lambda: calls.append(1), after_peak=after_peak, delay_s=DELAY_S), calls


def test_a_burst_is_trimmed_once_after_it_ends() -> None:
    trim, calls = _counted()
    _run(trim, [6])
    assert (calls, trim.inflight, trim.peak) == ([1], 0, 0)


def test_light_load_is_never_trimmed() -> None:
    trim, calls = _counted()
    _run(trim, [1, 3, 2, 3])
    assert calls == []


def test_waves_closer_than_the_delay_are_one_burst() -> None:
    trim, calls = _counted()
    _run(trim, [6, 6, 6], gap_s=DELAY_S / 10)
    assert len(calls) == 1


def test_no_trim_while_a_request_is_still_in_flight() -> None:
    trim, calls = _counted()

    async def go() -> None:
        for _ in range(6):
            trim.enter()
        for _ in range(6):
            trim.leave()
        trim.enter()                       # arrives before the delay is up, stays
        await asyncio.sleep(DELAY_S * 3)
        assert calls == []
        trim.leave()
        await asyncio.sleep(DELAY_S * 3)

    asyncio.run(go())
    assert calls == [1]


def test_glibc_trim_is_found_and_runs() -> None:
    trim = malloc_trim()
    assert trim is not None   # the images and CI are glibc
    assert trim() in (0, 1)
