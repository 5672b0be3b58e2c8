"""A throwaway cluster opens no HTTP port beyond loopback.

The session's cluster is started as every pd-cache command starts its own (``conftest.py``:
``local_cluster_options`` inside ``loopback_node``), with a pd-cache Serve app on it. Every
TCP socket its processes listen on is listed from ``/proc`` and sent a plain GET. Those
that answer HTTP (metrics export, autoscaler metrics, dashboard and runtime-env agents,
Serve's proxy) have no token in front of them and must be bound to loopback; Ray's gRPC
servers (token-authenticated) do not answer a GET and are exempt. ``pd-cache serve
--dashboard`` (the dashboard and the printed URLs) is checked in ``test_auth.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.integration.listening import descendants, http_listeners
from tests.integration.serving import running_app

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux /proc")
ARGS = {"model": "tiny", "page_size": 4, "num_prefill": 1, "num_decode": 1, "num_storage": 0,
        "cluster_name": None}


def test_the_session_cluster_opens_no_http_port_beyond_loopback(ray_cluster: Any) -> None:
    with running_app(ARGS, "pd-cache-ports") as url:
        found = http_listeners(descendants(os.getpid()))
    proxy_port = int(url.rsplit(":", 1)[1])
    assert {proxy_port, ray_cluster.metrics_port} <= {s.port for s in found}, found
    assert [s for s in found if not s.loopback] == []
