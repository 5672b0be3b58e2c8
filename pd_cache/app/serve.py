"""``pd-cache serve``: deploy a Ray Serve config (``deployments/``) over HTTP, on a local
Ray cluster of its own or one given by ``--address``."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

from pd_cache.app.session import ray_session

DEFAULT_HOST = "127.0.0.1"


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
    from ray import serve

    config = with_api_keys(load_serve_config(args.config), args.api_keys, args.host)
    http = config.http_options.model_dump(exclude_unset=True)
    port = args.port if args.port is not None else config.http_options.port
    http.update(host=args.host, port=port)
    apps = [(a, build_application(a)) for a in config.applications]  # bad args fail here
    with ray_session(args.address, runtime_env=_runtime_env(config)):
        serve.start(http_options=http, proxy_location=config.proxy_location)
        try:
            for entry, application in apps:
                serve.run(application, name=entry.name, route_prefix=entry.route_prefix)
                print(f"{entry.name}: http://{_url_host(args.host)}:{port}{entry.route_prefix}",
                      flush=True)
            _wait_for_stop()
        finally:
            if args.address:  # a shared cluster: remove only what this command deployed
                for entry, _ in apps:
                    serve.delete(entry.name)
                _destroy_named_clusters(config)
            else:
                serve.shutdown()
    return 0


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


def _runtime_env(config: Any) -> dict[str, Any] | None:
    envs = {repr(a.runtime_env) for a in config.applications if a.runtime_env}
    if len(envs) > 1:
        raise ValueError("applications[].runtime_env: pd-cache serve applies one runtime_env "
                         "to the whole job; give every application the same one")
    return next((a.runtime_env for a in config.applications if a.runtime_env), None)


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
