"""Serve's direct ingress for ``pd-cache serve``: the ingress replica listens on ``--port``
itself, so a request crosses no Serve proxy on its way in or its answer's way out.

Ray 2.60's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, experimental) gives each
ingress replica an HTTP server of its own, on a port the controller hands out from a range
(30000-31000 by default), and still starts one Serve proxy (on the head node, at
``http_options.port``). To keep one URL, ``--host``:``--port``, the range is pinned to that
one port and the proxy moves to a free port of its own on the same host: the replica
serves the URL, the proxy stays reachable only to whoever looks its port up. A range of one
port holds one replica per node, hence the refusal of ``ingress_replicas`` above 1 (the
second replica would find no port and the application would never start).

Two of Serve's waits are for load balancers that re-read the replicas' ports, which a
single pinned port has none of: a stopped replica's port is held back for 150 s before
another may take it, and a replica drains for at least 30 s before it stops. Both are set
to 0 here (a restarted replica may take the port back as soon as it can bind it: after a
crash, once the dead one's connections leave TIME_WAIT, since Serve binds without
SO_REUSEADDR; ``pd-cache serve`` stops without waiting half a minute); the environment or
the config's ``env_vars`` overrides each.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
TRUE = ("1", "true", "True")
# Serve's waits for a load balancer to re-read the replicas' ports: none here (module doc).
LB_WAITS = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def choose(flag: bool | None, given: Mapping[str, str], config: Any, joined: bool) -> bool:
    """Direct ingress on or off. Asked for (``flag``, else ``ENABLE`` in ``given``: the
    environment with the config's ``env_vars`` over it): as asked, ``ValueError`` if the
    config has more than one ingress replica or application. Not asked: on for a local
    cluster (not ``joined``) whose config has one of each, else off (Serve's proxy)."""
    asked = flag if flag is not None else \
        given[ENABLE] in TRUE if ENABLE in given else None
    apps = ingress_replicas(config)
    if asked:
        check_replicas(apps)
    if asked is not None:
        return asked
    return not joined and len(apps) == 1 and apps[0][1] == 1


def job_env(direct: bool, port: int, given: Mapping[str, str]) -> dict[str, str]:
    """The env vars of Serve's controller and replicas: with ``direct``, the ingress replica
    serves ``port`` (the range pinned to it, whatever ``given`` says) and Serve's two waits
    for load balancers are 0 unless ``given`` (the job's env_vars) sets them; without it,
    direct ingress off whatever the environment says."""
    if not direct:
        return {ENABLE: "0"}
    waits = {k: v for k, v in LB_WAITS.items() if k not in given}
    return {**waits, ENABLE: "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1)}   # the end is out


def check_replicas(apps: list[tuple[str, int]]) -> None:
    """``ValueError`` unless every application (name, ingress replicas) has one ingress
    replica: one port serves one replica."""
    for name, replicas in apps:
        if replicas > 1:
            raise ValueError(f"--direct-ingress: application {name!r} has ingress_replicas: "
                             f"{replicas}; the replica listens on --port itself and one port "
                             "takes one replica. Use ingress_replicas: 1, or serve through "
                             "Serve's proxy (--no-direct-ingress)")
    if len(apps) > 1:
        raise ValueError(f"--direct-ingress: the config has {len(apps)} applications; one "
                         "port serves one replica, so direct ingress serves one application")


def proxy_port(host: str) -> int:
    """A free port on ``host`` for Serve's proxy, off the URL the replica serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ingress_replicas(config: Any) -> list[tuple[str, int]]:
    """(name, ingress replicas) of every application of a Serve config: the pd-cache app's
    ``ingress_replicas``, or the deployments' ``num_replicas`` (1 when unset)."""
    from pd_cache.front.app_args import AppArgs

    out = []
    for entry in config.applications:
        if entry.import_path.startswith("pd_cache.front.serve"):
            out.append((entry.name, AppArgs.parse(entry.args).ingress.ingress_replicas))
        else:
            counts = [d.num_replicas for d in entry.deployments or []
                      if isinstance(d.num_replicas, int)]
            out.append((entry.name, max(counts, default=1)))
    return out


def check_serving(host: str, port: int, timeout_s: float = 10.0) -> None:
    """``ValueError`` unless the ingress replica answers Serve's health route on
    ``host``:``port`` (a Serve already running on a joined cluster keeps its own settings:
    direct ingress off, or its replicas on ports of their own)."""
    import urllib.error
    import urllib.request

    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/-/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            if answer.status == 200:
                return
    except (OSError, urllib.error.URLError) as exc:
        reason = str(exc)
    else:
        reason = f"status {answer.status}"
    raise ValueError(f"--direct-ingress: nothing serves {url} ({reason}); on a joined "
                       "cluster whose Serve already runs, its controller keeps its own "
                       "settings: serve through its proxy (--no-direct-ingress)")
