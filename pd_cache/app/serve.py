"""``pd-cache serve``: deploy a Ray Serve config (``deployments/``) over HTTP, on a local
Ray cluster of its own or one given by ``--address``."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pd_cache.app import direct_ingress
from pd_cache.app.flags import add_config_arguments, given_fields
from pd_cache.app.session import LOOPBACK, ray_session
from pd_cache.core.cluster_config import ClusterConfig

DEFAULT_HOST = LOOPBACK
PD_CACHE_APP = "pd_cache.front.serve:app"
# NOTE: Ray Serve's knobs `pd-cache serve` sets unless the environment or the config's
# runtime_env.env_vars does: user code and the handle router on the replica's main loop
# (no hand-off between Serve's loop thread and another), request-path logs buffered (an
# ERROR line still flushes them) and not copied to stderr. Measured: several ms of the
# serving overhead (docs/peers.md). Safe for pd-cache's ingress: its handlers are async,
# and its blocking calls (admin, pins, cache drops) run in threads (asyncio.to_thread),
# so the loop that answers Serve's health checks is never held long.
SERVE_KNOBS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
               "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
               "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
               "RAY_SERVE_LOG_TO_STDERR": "0"}
START_FAILED = """\
pd-cache serve: a Ray Serve actor died while the applications started ({error}).
Serve health-checks its proxy and controller from the start (ready within 5 s, then checks
every 10 s); on a machine busy with other work, or with fewer CPUs than the workers the
config asks for, they miss those checks and Serve kills them. Try: again once the machine
is quieter; fewer workers (--num-prefill 1 --num-decode 1); more time for the checks
(RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=30 RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S=30 in
the environment). Ray's logs: /tmp/ray/session_latest/logs (proxy_*.log, controller_*.log)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a Serve config file (YAML), e.g. "
                                       "deployments/serve_config.yaml")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address the HTTP proxy binds (default %(default)s)")
    parser.add_argument("--port", type=int, default=None,
                        help="HTTP port (default: the config's http_options.port)")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="API-key file (JSON: key -> tenant); without one (and without "
                             "PD_CACHE_API_KEYS_FILE) the server is open and binds loopback "
                             "only")
    parser.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="the ingress replica serves --host:--port itself, no Serve proxy "
                             "in between (Ray's direct ingress; one ingress replica). Default: "
                             "RAY_SERVE_ENABLE_DIRECT_INGRESS if the environment or the "
                             "config's env_vars set it, else on for a local cluster and a "
                             "config of one ingress replica, off otherwise")
    parser.add_argument("--dashboard", action="store_true",
                        help="start the Ray dashboard with the local cluster (on 127.0.0.1)")
    add_config_arguments(parser, ClusterConfig, f"the cluster: override the args of the "
                         f"config's pd-cache application ({PD_CACHE_APP})", overrides=True)


def load_serve_config(path: str | os.PathLike[str]) -> Any:
    """The config file as a validated ``ServeDeploySchema`` (``ValueError`` if it is not)."""
    import pydantic
    import yaml
    from ray.serve.schema import ServeDeploySchema

    try:
        raw = yaml.safe_load(Path(path).read_text())
        return ServeDeploySchema.model_validate(raw)
    except OSError as exc:
        raise ValueError(f"config: cannot read {path}: {exc.strerror}") from None
    except (yaml.YAMLError, pydantic.ValidationError) as exc:
        raise ValueError(f"config: {path} is not a Serve config: {exc}") from None


def build_application(app: Any) -> Any:
    """The Serve ``Application`` of one config entry: ``import_path`` is an application or
    a builder called with the entry's ``args``."""
    from ray.serve import Application

    module_name, _, attr = app.import_path.partition(":")
    target = getattr(importlib.import_module(module_name), attr or "app")
    if isinstance(target, Application):
        return target
    return target(app.args or {})


def run(args: argparse.Namespace) -> int:
    from ray.exceptions import RayActorError

    config = with_cluster_flags(load_serve_config(args.config),
                                given_fields(ClusterConfig, args))
    config = with_api_keys(config, args.api_keys, args.host)
    apps = [(a, build_application(a)) for a in config.applications]  # bad args fail here
    port = args.port if args.port is not None else config.http_options.port
    runtime_env = job_runtime_env(config)
    direct = direct_ingress.choose(args.direct_ingress, {**os.environ, **runtime_env["env_vars"]},
                                   config, joined=bool(args.address))
    runtime_env["env_vars"].update(direct_ingress.job_env(direct, port, runtime_env["env_vars"]))
    with ray_session(args.address, dashboard=args.dashboard, runtime_env=runtime_env):
        try:
            _serve(config, apps, args, port, direct)
        except RayActorError as exc:
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            print(START_FAILED.format(error=error), file=sys.stderr, flush=True)
            return 1
    return 0


def _serve(config: Any, apps: list[tuple[Any, Any]], args: argparse.Namespace, port: int,
           direct: bool) -> None:
    """Start Serve, deploy ``apps`` and serve until stopped; then remove what it started.
    ``direct``: the ingress replica serves ``port``, Serve's proxy a free port of its own."""
    from ray import serve

    http = config.http_options.model_dump(exclude_unset=True)
    http.update(host=args.host,
                port=direct_ingress.proxy_port(args.host) if direct else port)
    # NOTE: the config's logging_config (Serve's proxy and controller) and each app's (its
    # replicas): serve_config turns the access log off, a line per request on the way of
    # every answer (its file, the log monitor, this process's stderr).
    serve.start(http_options=http, proxy_location=config.proxy_location,
                logging_config=config.logging_config)
    try:
        for entry, application in apps:
            serve.run(application, name=entry.name, route_prefix=entry.route_prefix,
                      logging_config=entry.logging_config)
            if direct:
                direct_ingress.check_serving(args.host, port)
            print(f"{entry.name}: http://{_url_host(args.host)}:{port}{entry.route_prefix}"
                  + (" (direct ingress)" if direct else " (through Serve's proxy)"), flush=True)
        _wait_for_stop()
    finally:
        if args.address:  # a shared cluster: remove only what this command deployed
            for entry, _ in apps:
                serve.delete(entry.name)
            _destroy_named_clusters(config)
        else:
            serve.shutdown()


def with_cluster_flags(config: Any, flags: dict[str, Any]) -> Any:
    """The config with ``flags`` (``ClusterConfig`` fields) over the ``args`` of every
    pd-cache application; ``ValueError`` if flags are given and it has none."""
    if not flags:
        return config
    entries = [a for a in config.applications if a.import_path == PD_CACHE_APP]
    if not entries:
        flag = "--" + next(iter(flags)).replace("_", "-")
        raise ValueError(f"{flag}: the config has no pd-cache application "
                         f"(import_path {PD_CACHE_APP}) whose args it could set")
    for entry in entries:
        entry.args = {**(entry.args or {}), **flags}
    return config


def with_api_keys(config: Any, keys_file: str | None, host: str) -> Any:
    """The config with ``keys_file`` as every app's ``api_keys_file``; ``ValueError`` if an
    app would run open (no keys at all) on an address other than loopback."""
    from pd_cache.front.app_args import AppArgs
    from pd_cache.front.tenants import KEYS_ENV

    for entry in config.applications:
        if keys_file:
            entry.args = {**(entry.args or {}), "api_keys_file": keys_file}
        keyed = AppArgs.parse(entry.args).ingress.api_keys_file or os.environ.get(KEYS_ENV)
        if not keyed and not _loopback(host):
            raise ValueError(f"--host {host}: application {entry.name!r} has no API keys "
                             "(open mode) and would serve a non-loopback address; give "
                             "--api-keys FILE or bind 127.0.0.1")
        print(f"{entry.name}: " + ("API keys required" if keyed else
                                   "open mode (no API keys): loopback only"), flush=True)
    return config


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _destroy_named_clusters(config: Any) -> None:
    """Remove the detached actors of every named cluster the config's apps started."""
    from pd_cache.cluster.pd_cluster import PDCluster
    from pd_cache.front.app_args import AppArgs

    for entry in config.applications:
        name = AppArgs.parse(entry.args).ingress.cluster_name
        if name:
            PDCluster.destroy(name)


def job_runtime_env(config: Any, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The runtime_env of the job `pd-cache serve` runs: the applications' one (Serve's
    controller and proxy inherit it), with ``SERVE_KNOBS`` that neither it nor ``environ``
    sets."""
    envs = {repr(a.runtime_env) for a in config.applications if a.runtime_env}
    if len(envs) > 1:
        raise ValueError("applications[].runtime_env: pd-cache serve applies one runtime_env "
                         "to the whole job; give every application the same one")
    runtime_env = dict(next((a.runtime_env for a in config.applications if a.runtime_env),
                            None) or {})
    given = {**environ, **runtime_env.get("env_vars", {})}
    runtime_env["env_vars"] = {**{k: v for k, v in SERVE_KNOBS.items() if k not in given},
                               **runtime_env.get("env_vars", {})}
    return runtime_env


def _wait_for_stop() -> None:
    """Say it serves, then block until Ctrl-C or SIGTERM (both end in a clean shutdown,
    exit 0). The handler is in place before the line is printed: whoever reacts to the
    line by stopping the command is never early."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print("serving; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
