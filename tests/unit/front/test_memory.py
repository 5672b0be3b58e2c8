"""The ingress gives a burst's freed heap back once it is quiet, and only then."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml

from pd_cache.front.memory import (
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    IdleTrim,
    TrimWhenIdle,
    malloc_trim,
)

ROOT = Path(__file__).resolve().parents[3]

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


# -- Serve's proxy ---------------------------------------------------------------------------
def test_the_proxy_middleware_trims_after_a_burst_of_http_requests_only() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await asyncio.sleep(DELAY_S / 10)
        seen.append(scope["type"])

    middleware = TrimWhenIdle(app)
    calls: list[int] = []
    middleware.idle.trim, middleware.idle.delay_s = (lambda: calls.append(1)), DELAY_S

    async def go() -> None:
        await middleware({"type": "lifespan"}, None, None)
        await asyncio.gather(*(middleware({"type": "http"}, None, None) for _ in range(70)))
        await asyncio.sleep(DELAY_S * 5)

    asyncio.run(go())
    assert (len(seen), calls, middleware.idle.peak) == (71, [1], 0)


def test_serve_takes_the_proxy_middlewares_from_the_config_env() -> None:
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    config = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    env = config["applications"][0]["runtime_env"]["env_vars"]
    (middleware,) = validate_http_proxy_callback_return(
        call_function_from_import_path(env[PROXY_CALLBACK_ENV]))
    assert middleware.cls is TrimWhenIdle
    # KubeRay: the app's runtime_env does not reach the proxy; every pod has it in its env.
    service = yaml.safe_load((ROOT / "k8s" / "rayservice.yaml").read_text())
    spec = service["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            assert {"name": PROXY_CALLBACK_ENV, "value": PROXY_CALLBACK} in container["env"]
