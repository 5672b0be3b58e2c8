"""One local Ray cluster per pytest session; actors are reused through fixtures.

Every cluster the tests start is a throwaway one that admits only its own processes: one
fresh token per pytest session (``cluster_token``), in the environment of every Ray process
they start, the multi-node module's cluster included. The session's cluster is started as a
pd-cache command starts its own (``local_cluster_options`` inside ``loopback_node``): every
HTTP port on loopback, which ``test_serve.py`` checks. Serve's controller and proxy start
once on it (``serve_url``); each Serve module runs its app there and deletes it when done.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from pd_cache.app.session import ClusterToken, cluster_token, local_cluster_options, loopback_node
from tests.integration.serving import DIRECT_INGRESS, direct_ingress_env, free_port

ray = pytest.importorskip("ray")

# The job env `pd-cache serve` gives its cluster (deployments/serve_config.yaml's runtime_env):
# the workers and L3 shards add RAY_ENABLE_ZERO_COPY_TORCH_TENSORS in their own.
SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.yaml"
JOB_ENV = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["runtime_env"]


class RayCluster(NamedTuple):
    address: str
    metrics_port: int
    ingress_port: int | None = None   # DIRECT_INGRESS: the port every app's replica serves


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``multinode`` tests run last, after the unit tests too: each such module ends the
    session's cluster below to start its own, and nothing starts it again."""
    items.sort(key=lambda item: item.get_closest_marker("multinode") is not None)


def _free_port(low: int = 20000, high: int = 30000) -> int:
    # NOTE: outside 10002-19999, Ray's worker port range.
    for port in range(low, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for the Ray metrics exporter")


@pytest.fixture(scope="session")
def ray_token() -> Iterator[ClusterToken]:
    """Token authentication for every Ray cluster of this pytest session."""
    with cluster_token() as token:
        yield token


@pytest.fixture(scope="session")
def ray_cluster(ray_token: ClusterToken) -> Iterator[RayCluster]:
    port = _free_port()
    # NOTE: "local" (local_cluster_options) always starts a cluster of its own: never attach
    # a test session to some other Ray cluster that happens to run on this machine.
    options = local_cluster_options(metrics_interval_ms=1000) | {"num_cpus": 4}
    ingress = free_port() if DIRECT_INGRESS else None
    env = {**JOB_ENV, "env_vars": {**JOB_ENV["env_vars"], **(
        direct_ingress_env(ingress) if ingress else {})}}
    with loopback_node():
        info = ray.init(
            **options,
            _metrics_export_port=port,
            runtime_env=env,
            logging_level="WARNING",
        )
        yield RayCluster(address=info.address_info["gcs_address"], metrics_port=port,
                         ingress_port=ingress)
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_cluster: RayCluster) -> Iterator[str]:
    """Serve on the session's cluster, started once: its proxy on 127.0.0.1 at a free port."""
    serve = pytest.importorskip("ray.serve")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{ray_cluster.ingress_port or port}"
    # NOTE: a multinode module may have ended the session's cluster already (and Serve with it)
    if ray.is_initialized() and ray.get_runtime_context().gcs_address == ray_cluster.address:
        serve.shutdown()
