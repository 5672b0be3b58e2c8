"""The Ray session of a ``pd-cache`` command: join a cluster, or start a throwaway one.

A throwaway cluster admits only its own processes. Ray's gRPC servers (GCS, raylet,
workers) listen on every interface whatever node address they are given, so the cluster
runs with Ray token authentication and a token of its own, made fresh for it and removed
with it (``cluster_token``). A cluster joined with ``--address`` keeps its own
authentication: nothing here touches it.

The throwaway node's address is loopback (``LOOPBACK``, ``loopback_node``), and Ray then
binds every HTTP server it runs there: the metrics export port, the autoscaler monitor's
metrics, the dashboard agent, the runtime-env agent and (with ``--dashboard``) the dashboard
and its metrics. Those speak plain HTTP without the token, so none of them may listen on
another address; ``tests/integration/test_serve.py`` checks it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

# RAY_AUTH_TOKEN would take precedence over RAY_AUTH_TOKEN_PATH: it is unset for the cluster.
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")
# Ray's switch for a single-machine node on loopback (its default on macOS and Windows).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
TOKEN_FILE = "auth_token"
LOOPBACK = "127.0.0.1"


class Session(NamedTuple):
    metrics_url: str | None   # this node's Prometheus endpoint (None: no metrics agent)


class ClusterToken(NamedTuple):
    token: str
    path: str  # the 0600 file RAY_AUTH_TOKEN_PATH names, in a 0700 directory of its own


@contextlib.contextmanager
def ray_session(address: str | None = None, *, dashboard: bool = False,
                runtime_env: dict[str, Any] | None = None,
                metrics_interval_ms: int | None = None) -> Iterator[Session]:
    """Join ``address``, or start a throwaway local cluster with a token of its own and
    every HTTP port on loopback; prints the node's metrics URL (and the dashboard's).

    ``metrics_interval_ms``: how often a local cluster's processes export their metrics
    (Ray's default is 10 s; ``pd-cache bench`` reads the counters back and sets 1 s).

    SIGTERM (an orchestrator's stop) interrupts the body as Ctrl-C does; on the way out Ray
    is shut down and the token removed, and an interrupt the body does not handle itself
    ends the command with exit status 143 (130 after Ctrl-C) rather than a traceback.
    """
    import ray

    with _interruptible() as arm, contextlib.ExitStack() as stack:
        if address:
            local: dict[str, Any] = {"address": address}
        else:
            auth = stack.enter_context(cluster_token())
            stack.enter_context(loopback_node())
            local = local_cluster_options(dashboard=dashboard,
                                          metrics_interval_ms=metrics_interval_ms)
        context = ray.init(runtime_env=runtime_env, logging_level="WARNING", **local)
        stack.callback(ray.shutdown)
        arm()
        session = Session(metrics_url=node_metrics_url())
        if session.metrics_url:
            print(f"Ray metrics (Prometheus text): {session.metrics_url}", flush=True)
        if dashboard and not address and context.dashboard_url:
            print(f"Ray dashboard: http://{context.dashboard_url} (it asks for the token in "
                  f"{auth.path}, removed when this command ends)", flush=True)
        yield session


def local_cluster_options(*, dashboard: bool = False,
                          metrics_interval_ms: int | None = None) -> dict[str, Any]:
    """``ray.init`` keywords of a throwaway single-node cluster: its own (``"local"``: never
    one that already runs here), on loopback, metrics on."""
    # NOTE: "local" always starts a cluster; None would attach to RAY_ADDRESS or to any
    # cluster already running on this machine. The node address is loopback only inside
    # loopback_node (Ray turns a loopback address given here into the machine's own).
    options: dict[str, Any] = {"address": "local", "num_cpus": max(4, os.cpu_count() or 1),
                               "include_dashboard": dashboard, "dashboard_host": LOOPBACK,
                               "_node_ip_address": LOOPBACK}
    if metrics_interval_ms is not None:
        options["_system_config"] = {"metrics_report_interval_ms": metrics_interval_ms}
    return options


def node_metrics_url() -> str | None:
    """The Prometheus endpoint of the metrics agent on this driver's Ray node (``None``:
    none runs)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("NodeID") == here and node.get("Alive") and port:
            return f"http://{node['NodeManagerAddress']}:{port}/metrics"
    return None


@contextlib.contextmanager
def cluster_token() -> Iterator[ClusterToken]:
    """Token authentication for the Ray cluster this process starts next.

    Writes a fresh random token to a private file (0600, in a new 0700 temporary
    directory) and sets ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` in
    ``os.environ`` (``RAY_AUTH_TOKEN`` unset): every process the cluster starts (GCS,
    raylet, workers, actors, Serve) inherits them, and Ray neither generates a token nor
    writes ``~/.ray/auth_token``. On exit the environment is restored and the file removed;
    call it around the cluster's whole life (start to shutdown).
    """
    private = tempfile.mkdtemp(prefix="pd-cache-ray-")  # mode 0700
    try:
        token = secrets.token_hex(32)
        path = os.path.join(private, TOKEN_FILE)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(token)
        saved = {name: os.environ.get(name) for name in AUTH_ENV}
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=path)
        _reload_ray_auth()
        try:
            yield ClusterToken(token, path)
        finally:
            for name, value in saved.items():
                _restore(name, value)
            _reload_ray_auth()
    finally:
        shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """A Ray node this process starts next has the address 127.0.0.1, so Ray binds its HTTP
    servers to loopback (it does when the node's address is loopback, and only then).

    NOTE: Ray replaces a loopback ``_node_ip_address`` with the machine's routable address
    unless its cluster switch (``LOOPBACK_ENV``) is off, as it is by default on macOS and
    Windows. The switch is off in ``os.environ`` for the cluster's life (its processes read
    it when they start) and in this process's copy of Ray's constants, read at import; the
    machine's routable address is only needed by nodes that other machines join, and a
    throwaway cluster has none.
    """
    from ray._private import ray_constants

    saved_env, saved = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        _restore(LOOPBACK_ENV, saved_env)


def _reload_ray_auth() -> None:
    # NOTE: this process reads RAY_AUTH_MODE into Ray's config when ray is imported and
    # caches the first token it loads; both are reloaded from the environment just set (as
    # Ray does when it turns authentication on itself), or the driver would not send the
    # token its own cluster asks for.
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def _interruptible() -> Iterator[Callable[[], None]]:
    """Yields ``arm``: from then on SIGTERM raises ``KeyboardInterrupt`` as SIGINT does, so
    every ``finally`` on the way out runs; either ends in ``SystemExit(128 + signal)``.

    NOTE: ``ray.init`` installs SIGTERM handlers of its own (the core worker's dumps a stack
    and aborts the driver, skipping every cleanup), so ``arm`` is called after it; the
    handler from before the session is restored at its end.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    received = [signal.SIGINT]

    def interrupt(signum: int, _frame: Any) -> None:
        received[0] = signal.Signals(signum)
        raise KeyboardInterrupt

    def arm() -> None:
        if main:
            signal.signal(signal.SIGTERM, interrupt)

    try:
        yield arm
    except KeyboardInterrupt:
        print(f"pd-cache: stopped by {received[0].name}", file=sys.stderr, flush=True)
        raise SystemExit(128 + received[0]) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
