"""Running the Serve app in a test: on the session's Serve instance (the ``serve_url``
fixture: one controller and proxy on 127.0.0.1 for the whole session), removed when done."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Mapping
from typing import Any


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
