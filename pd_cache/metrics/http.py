"""A ``prometheus_client`` registry served over HTTP from a daemon thread."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server


class MetricsServer:
    """A running ``prometheus_client`` HTTP server; ``stop()`` (or ``with``) ends it."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_http(registry: Any, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread."""
    import prometheus_client as pc

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
    server_class = _IPv6Server if ":" in host else _Server
    httpd = make_server(host, port, pc.make_wsgi_app(registry), server_class, _QuietHandler)
    # NOTE: a short poll interval so that stop() returns in ~50 ms, not serve_forever's 0.5 s.
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              name="pd-cache-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per scrape on stderr is noise
