"""Running the Serve app in a test: on the session's Serve instance (the ``serve_url``
fixture: one controller and proxy on 127.0.0.1 for the whole session), removed when done.

``PD_CACHE_TEST_DIRECT_INGRESS=1`` runs the session's Serve with direct ingress, as
``pd-cache serve`` does by default (``DIRECT_INGRESS``): each app's one ingress replica
serves HTTP itself, no proxy in between; a module whose app has two ingress replicas runs it
with one and skips what needs two. Serve's replica port range is ``PORTS`` ports from the
session's URL (not one, as ``pd-cache serve`` pins it): a replica cannot bind the port of
the app before it while that port's closed connections linger in TIME_WAIT (Serve binds
without SO_REUSEADDR), so each app takes the next free one and ``running_app`` yields it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

DIRECT_INGRESS = os.environ.get("PD_CACHE_TEST_DIRECT_INGRESS") == "1"
PORTS = 16


def direct_ingress_env(port: int) -> dict[str, str]:
    """The session's job env for direct ingress: ``pd-cache serve``'s, over ``PORTS`` ports."""
    from pd_cache.app.direct_ingress import job_env

    return job_env(True, port, {}) | {"RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + PORTS)}


def _replica_url(base: str, name: str) -> str:
    """The URL of ``name``'s ingress replica: the port of the range from ``base`` whose
    server answers Serve's routes with that app."""
    start = int(base.rsplit(":", 1)[1])
    for port in range(start, start + PORTS):
        url = f"http://127.0.0.1:{port}"
        try:
            with urllib.request.urlopen(url + "/-/routes", timeout=2) as r:
                if json.loads(r.read()) == {"/": name}:
                    return url
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no replica of {name!r} answers on ports {start}-{start + PORTS - 1}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(serve_url: str, args: Mapping[str, Any], name: str) -> Iterator[str]:
    """The pd-cache app built from ``args``, served as ``name`` at ``serve_url`` (the
    session's Serve proxy); yields that URL. Deleted on the way out, its replicas stopped."""
    from ray import serve

    from pd_cache.front.serve import app_builder

    try:
        serve.run(app_builder(dict(args)), name=name, route_prefix="/")
        yield _replica_url(serve_url, name) if DIRECT_INGRESS else serve_url
    finally:
        serve.delete(name)
