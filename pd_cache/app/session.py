"""The Ray session of a ``pd-cache`` command: join a cluster, or start a throwaway one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def ray_session(address: str | None = None, *, dashboard: bool = False,
                runtime_env: dict[str, Any] | None = None) -> Iterator[None]:
    """Join ``address``, or start a throwaway local cluster (auth off for it alone)."""
    import ray

    previous = os.environ.get("RAY_AUTH_MODE")
    local: dict[str, Any] = {}
    if not address:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        local = {"num_cpus": max(4, os.cpu_count() or 1), "include_dashboard": dashboard}
    ray.init(address=address, runtime_env=runtime_env, logging_level="WARNING", **local)
    try:
        yield
    finally:
        ray.shutdown()
        if not address:
            _restore("RAY_AUTH_MODE", previous)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
