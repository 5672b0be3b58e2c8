"""Running the Serve app in a test: on the session's Serve instance (the ``serve_url``
fixture: one controller and proxy on 127.0.0.1 for the whole session), removed when done.

``PD_CACHE_TEST_DIRECT_INGRESS=1`` runs the session's Serve as ``pd-cache serve
--direct-ingress`` does (``DIRECT_INGRESS``): each app's one ingress replica serves the
session's URL itself, Serve's proxy sits on a port of its own; a module whose app has two
ingress replicas runs it with one and skips what needs two."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

DIRECT_INGRESS = os.environ.get("PD_CACHE_TEST_DIRECT_INGRESS") == "1"


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
        yield serve_url
    finally:
        serve.delete(name)
