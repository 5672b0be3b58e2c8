"""Running the Serve app in a test: on 127.0.0.1, a free port, removed when done."""

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
def running_app(args: Mapping[str, Any], name: str) -> Iterator[str]:
    """The pd-cache app built from ``args``, served as ``name``; yields its base URL."""
    from ray import serve

    from pd_cache.front.serve import app_builder

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app_builder(dict(args)), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(name)
        serve.shutdown()
