"""The pd-cache Ray Serve application: one HTTP ingress in front of a ``PDCluster``.

::

    POST /v1/generate  {"input_ids": [...], "max_new_tokens": 16, "cache_salt": ..,
                        "extra_key": .., "rid": ..}
        -> 200 {"rid", "output_ids", "num_prompt_tokens", "cached_tokens": {tier: n},
                "ttft_ms", "latency_ms"}
        -> 400 {"error", "field"}   malformed JSON, a wrong type, an unknown field, or what
                                    ``Req`` / the model refuse (empty prompt, token id out
                                    of the vocabulary, prompt beyond the context, namespace)
        -> 413 {"error", "field": "body"}  a body over ``max_body_bytes``
        -> 503 {"error", "field": null}    a worker died or the request ran past
                                           ``request_timeout_s``: never a hang
    GET /healthz -> 200 when every worker and shard answers within ``health_timeout_s``,
                    else 503

The ingress is thin: it decodes the body into a typed ``msgspec`` Struct, hands the fields
to ``PDCluster.generate_async`` (which validates them as a ``Req``) and maps the outcome
to a status. It is one replica on purpose: the router's prefix state lives in it.

``app_builder(args)`` builds the application from a Serve config's ``args`` (see
``deployments/serve_config.yaml``); ``app`` is the same builder, for ``import_path``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
from ray import serve

from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.fields import check_positive, check_positive_int, from_mapping
from pd_cache.core.request import DeadlineExceeded

log = logging.getLogger(__name__)

GENERATE_PATH = "/v1/generate"
HEALTH_PATH = "/healthz"
# NOTE: a tiny/small-model prompt of a few thousand ids is ~50 KB of JSON; 1 MiB leaves
# room and still refuses a body that would only waste the replica's memory.
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class IngressConfig:
    """The HTTP ingress's own knobs; every other ``args`` key is a ``ClusterConfig`` field."""

    request_timeout_s: float = 30.0
    health_timeout_s: float = 5.0
    max_body_bytes: int = MAX_BODY_BYTES
    cluster_name: str | None = "pd-cache"

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "health_timeout_s"):
            check_positive(name, getattr(self, name))
        check_positive_int("max_body_bytes", self.max_body_bytes)
        if self.cluster_name is not None and not re.fullmatch(r"[\w.-]{1,64}", self.cluster_name):
            raise ValueError(f"cluster_name: expected 1-64 of [A-Za-z0-9_.-] or null, got "
                             f"{self.cluster_name!r}")


class AppArgs(NamedTuple):
    """The ``args`` of a Serve config, read into the two configs they describe."""

    cluster: ClusterConfig
    ingress: IngressConfig

    @classmethod
    def parse(cls, args: Mapping[str, Any] | None) -> AppArgs:
        """``ValueError`` naming the key: unknown, of a wrong type, or of a bad value."""
        args = dict(args or {})
        ingress_keys = {f.name for f in dataclasses.fields(IngressConfig)}
        cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig)}
        unknown = sorted(set(args) - ingress_keys - cluster_keys)
        if unknown:
            raise ValueError(f"args.{unknown[0]}: unknown key; expected one of "
                             f"{sorted(ingress_keys | cluster_keys)}")
        pick = lambda keys: {k: v for k, v in args.items() if k in keys}  # noqa: E731
        return cls(from_mapping(ClusterConfig, pick(cluster_keys), "args."),
                   from_mapping(IngressConfig, pick(ingress_keys), "args."))


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON body of ``POST /v1/generate``; values are checked again as a ``Req``."""

    input_ids: list[int]
    max_new_tokens: int = 16
    cache_salt: str | None = None
    extra_key: str | None = None
    rid: str | None = None


class HTTPError(Exception):
    """A refused request: status, message and the field it concerns."""

    def __init__(self, status: int, error: str, field: str | None) -> None:
        super().__init__(error)
        self.status, self.error, self.field = status, error, field


_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_IN_BACKTICKS = re.compile(r"field `(?P<name>[^`]+)`")
_LEADING_FIELD = re.compile(r"^(?P<field>[A-Za-z_][\w.]*(?:\[\d+\])?):")


def decode_body(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> GenerateBody:
    """``body`` as a ``GenerateBody``; ``HTTPError`` 413 if too large, 400 naming the field
    for malformed JSON, a wrong type, a missing or an unknown field."""
    if len(body) > max_bytes:
        raise HTTPError(413, f"body of {len(body)} bytes exceeds {max_bytes}", "body")
    try:
        return msgspec.json.decode(body, type=GenerateBody)
    except msgspec.ValidationError as exc:
        raise HTTPError(400, str(exc), _msgspec_field(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise HTTPError(400, f"malformed JSON: {exc}", "body") from None


def _msgspec_field(message: str) -> str:
    at = _AT_PATH.search(message)
    if at and at.group("path"):
        return at.group("path")
    named = _IN_BACKTICKS.search(message) or _LEADING_FIELD.match(message)
    return named.group(named.lastgroup or 1) if named else "body"


def value_error_field(exc: ValueError) -> str:
    """The field a pd-cache ``ValueError`` names first (``input_ids[3]: ...``)."""
    match = _LEADING_FIELD.match(str(exc))
    return match.group("field") if match else "body"


def completion_json(rid: str, out: Any) -> dict[str, Any]:
    return {"rid": rid, "output_ids": out.output_ids, "num_prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.cached_tokens, "ttft_ms": round(out.ttft_s * 1e3, 3),
            "latency_ms": round(out.latency_s * 1e3, 3)}


@serve.deployment(num_replicas=1, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0})
class PDCacheIngress:
    """Starts a ``PDCluster`` and serves it over HTTP; see the module docstring."""

    def __init__(self, args: AppArgs) -> None:
        self.args = args.ingress
        # NOTE: a named cluster's actors are detached: a restarted replica attaches to them.
        self.cluster = PDCluster.start(args.cluster, name=args.ingress.cluster_name)
        self._rids = itertools.count()

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        try:
            status, payload = await self._route(request)
        except HTTPError as exc:
            status, payload = exc.status, {"error": exc.error, "field": exc.field}
        return Response(msgspec.json.encode(payload), status_code=status,
                        media_type="application/json")

    async def _route(self, request: Any) -> tuple[int, dict[str, Any]]:
        path, method = request.url.path.rstrip("/") or "/", request.method
        if path == GENERATE_PATH:
            _need_method(method, "POST")
            return 200, await self.generate(await self._body(request))
        if path == HEALTH_PATH:
            _need_method(method, "GET")
            return await self.health()
        raise HTTPError(404, f"no route {path!r}; try POST {GENERATE_PATH} or GET {HEALTH_PATH}",
                        None)

    async def _body(self, request: Any) -> bytes:
        limit = self.args.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"body of {declared} bytes exceeds {limit}", "body")
        return await request.body()

    async def generate(self, raw: bytes) -> dict[str, Any]:
        body = decode_body(raw, self.args.max_body_bytes)
        if body.rid == "":
            raise HTTPError(400, "rid: expected a non-empty str, got ''", "rid")
        n = next(self._rids)
        rid = body.rid if body.rid is not None else f"http-{n}"
        # NOTE: the cluster keys slots and locks by rid, so two clients reusing one rid
        # must not collide: the internal rid is unique, the reply echoes the client's.
        # NOTE: the deadline starts here, when the ingress has the request: Serve hands
        # over no arrival time, so time spent in Serve's own queues is not counted.
        fields = {"rid": f"{rid}#{n}", "input_ids": body.input_ids,
                  "max_new_tokens": body.max_new_tokens, "cache_salt": body.cache_salt,
                  "extra_key": body.extra_key,
                  "deadline": time.time() + self.args.request_timeout_s}
        try:
            out = await asyncio.wait_for(self.cluster.generate_async(fields),
                                         self.args.request_timeout_s)
        except ValueError as exc:
            raise HTTPError(400, str(exc), value_error_field(exc)) from None
        except (asyncio.TimeoutError, DeadlineExceeded):
            raise HTTPError(503, f"no answer within {self.args.request_timeout_s} s",
                            None) from None
        except Exception as exc:  # noqa: BLE001  (a dead worker, a failed task)
            log.warning("request %s failed: %s: %s", rid, type(exc).__name__, exc)
            raise HTTPError(503, f"internal fault: {type(exc).__name__}", None) from None
        return completion_json(rid, out)

    async def health(self) -> tuple[int, dict[str, Any]]:
        """200 once prefill and decode each have a live worker, else 503; with the live
        workers by role."""
        state = await self.cluster.health(self.args.health_timeout_s)
        body = {"status": "ok" if state["healthy"] else "unhealthy",
                "model": self.cluster.config.model, "live": state["live"],
                "workers": state["workers"]}
        return (200 if state["healthy"] else 503), body

    def __del__(self) -> None:
        # Serve calls this when the replica shuts down. An unnamed cluster's actors go with
        # it; a named one's stay for the next replica (`pd-cache serve` removes them at exit).
        cluster = getattr(self, "cluster", None)
        if cluster is not None and self.args.cluster_name is None:
            cluster.shutdown(check=False)


def _need_method(method: str, allowed: str) -> None:
    if method != allowed:
        raise HTTPError(405, f"method {method} not allowed; use {allowed}", None)


def app_builder(args: Mapping[str, Any] | None = None) -> Any:
    """The Serve application of a config's ``args``; ``ValueError`` naming a bad arg."""
    return PDCacheIngress.bind(AppArgs.parse(args))  # bad args fail here, before any actor


app = app_builder

__all__ = ["AppArgs", "GenerateBody", "HTTPError", "IngressConfig", "PDCacheIngress",
           "app", "app_builder", "decode_body", "value_error_field"]
