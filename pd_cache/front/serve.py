"""The pd-cache Ray Serve application: one HTTP ingress in front of a ``PDCluster``.

::

    POST /v1/completions        OpenAI completions (text or token ids), streaming or not
    POST /v1/chat/completions   OpenAI chat completions, streaming or not
    GET  /v1/models             the served model
    POST /v1/generate           token ids in, token ids out (pd-cache's own API)
    GET  /healthz               200 once prefill and decode each have a live worker
    POST /admin/drop_caches     empty every cache tier (admin keys; a benchmark's reset)
    GET  /admin/tenants/{t}/pins, POST .../pins/drop   a tenant's pins (``front.pinning``)

With an API-key file (``api_keys_file``, ``PD_CACHE_API_KEYS_FILE``) every ``/v1`` route
needs ``Authorization: Bearer <key>`` and the namespace is derived from the key's tenant
(``pd_cache.front.tenants``); without one the server is open (loopback only). At most
``max_pending`` requests are admitted at once; beyond that, 429 with ``Retry-After``, but
for a tenant within its share (``front.flow``; its prefills wait their turn by tenant,
``cluster.turns``). Each
key's rate limits and each tenant's usage metrics: ``pd_cache.front.guard``.
Errors are OpenAI's shape (``pd_cache.front.http``). Streams are Server-Sent Events,
one chunk per token as decode draws it (``PDCluster.stream``). A client that goes away,
streaming or not, cancels its request: Serve cancels the handler's task, and the cluster
drops the request from its prefill queue or decode batch.

``ingress_replicas`` replicas (each with its own router and ``max_pending``) share one
named cluster; request and completion ids are random, so they are unique across replicas
and tell no tenant how many requests others sent.

``app_builder(args)`` builds the application from a Serve config's ``args`` (see
``deployments/serve_config.yaml``); ``app`` is the same builder, for ``import_path``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from ray import serve

from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.request import Req, SamplingParams
from pd_cache.core.wire import Completion
from pd_cache.front import openai
from pd_cache.front.admin import keys_call, tenant_route
from pd_cache.front.app_args import AppArgs, IngressConfig
from pd_cache.front.flow import Admission, Place, primed, unavailable
from pd_cache.front.guard import TenantGuard, TenantL3
from pd_cache.front.hf_tokenizer import tokenizer_for
from pd_cache.front.http import HTTPError, check_rid, decode_json, read_body, value_error
from pd_cache.front.memory import IdleTrim, malloc_trim
from pd_cache.front.pinning import PinGate
from pd_cache.front.tenants import KEYS_ENV, Tenant, Tenants, Unauthorized

log = logging.getLogger(__name__)

OPEN = Tenant("", admin=True)   # open mode: the client's own salt; details shown (loopback)


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON body of ``POST /v1/generate``; values are checked again as a ``Req``."""

    input_ids: list[int]
    max_new_tokens: int = 16
    cache_salt: str | None = None
    extra_key: str | None = None
    rid: str | None = None
    stop_token_ids: list[int] = []


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import Response

    return Response(msgspec.json.encode(payload), status_code=status, headers=headers,
                    media_type="application/json")


@serve.deployment(num_replicas=1, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class PDCacheIngress:
    """Starts (or attaches to) a ``PDCluster`` and serves it over HTTP."""

    def __init__(self, args: AppArgs) -> None:
        self.args = args.ingress
        keys = args.ingress.api_keys_file or os.environ.get(KEYS_ENV)
        self.tenants = Tenants.from_file(keys) if keys else None
        if self.tenants is None:
            log.warning("no API keys: serving in open mode (clients choose their namespace)")
        self.guard = TenantGuard(self.tenants, args.ingress.ingress_replicas)   # rates, usage
        # NOTE: a named cluster's actors are detached: a restarted replica attaches to them.
        # NOTE: one secret for tenant salts and L3 keys; open mode draws a random one.
        secret = self.tenants.secret if self.tenants is not None else None
        self.cluster = PDCluster.start(args.cluster, name=args.ingress.cluster_name,
                                       secret=secret)
        self.tenant_l3 = None if self.tenants is None or not self.cluster.storage else \
            TenantL3(self.cluster, self.tenants, self.guard.metrics,
                     args.cluster.metrics_interval_s).start()   # quotas, bytes held
        self.model = args.cluster.model
        # NOTE: a checkpoint's own tokenizer and chat template; the byte one for presets.
        self.tokenizer = tokenizer_for(self.cluster.pd.model)
        self.admission = Admission(args.ingress.max_pending)
        self.pins = PinGate(self.cluster, self.tenants, self.guard.metrics)
        self._idle_trim = IdleTrim(malloc_trim())   # a burst's freed heap goes back after it

    async def __call__(self, request: Any) -> Any:
        self._idle_trim.enter()
        try:
            return await self._route(request)
        except HTTPError as exc:
            return _json(exc.status, exc.body(), exc.headers)
        finally:
            self._idle_trim.leave()

    async def _route(self, request: Any) -> Any:
        path, method = request.url.path.rstrip("/") or "/", request.method
        routes = {"/v1/completions": ("POST", self.completions),
                  "/v1/chat/completions": ("POST", self.chat),
                  "/v1/generate": ("POST", self.generate),
                  "/v1/models": ("GET", self.models), "/healthz": ("GET", self.health),
                  "/admin/drop_caches": ("POST", self.drop_caches),
                  "/admin/keys/rotate": ("POST", functools.partial(self.keys, "rotate", None)),
                  "/admin/keys/retire": ("POST", functools.partial(self.keys, "retire", None))}
        routed = tenant_route(path)
        if routed is not None:
            routes[path] = (routed[0], functools.partial(self.keys, routed[1], routed[2]))
        if path not in routes:
            raise HTTPError(404, f"no route {path!r}; try one of {sorted(routes)}", None,
                            "not_found")
        allowed, handler = routes[path]
        if method != allowed:
            raise HTTPError(405, f"method {method} not allowed; use {allowed}", None)
        return await handler(request)

    # -- the routes ------------------------------------------------------------------------

    async def completions(self, request: Any) -> Any:
        return await self._openai(request, chat=False)

    async def chat(self, request: Any) -> Any:
        return await self._openai(request, chat=True)

    async def models(self, request: Any) -> Any:
        self._tenant(request)
        return _json(200, {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "pd-cache"}]})

    async def health(self, request: Any) -> Any:
        """200 once prefill and decode each have a live worker, else 503."""
        state = await self.cluster.health(self.args.health_timeout_s)
        body = {"status": "ok" if state["healthy"] else "unhealthy", "model": self.model,
                "live": state["live"], "workers": state["workers"]}
        return _json(200 if state["healthy"] else 503, body)

    async def drop_caches(self, request: Any) -> Any:
        """Empty every cache tier (``PDCluster.drop_caches``); admin keys only."""
        self._admin(request, "emptying the caches")
        dropped = await asyncio.to_thread(self.cluster.drop_caches)
        return _json(200, {"dropped_pages": dropped})

    async def keys(self, action: str, tenant: str | None, request: Any) -> Any:
        """Rotate or retire the L3 keys, purge ``tenant`` (``front.admin``), list or drop
        its pins (``front.pinning``); admin keys only."""
        if action in ("pins", "drop_pins") and tenant is not None:
            self._admin(request, "a tenant's pins")
            return _json(200, await self.pins.call(action, tenant))
        self._admin(request, "changing the L3 keys")
        return _json(200, await keys_call(self.cluster, action, tenant))

    async def generate(self, request: Any) -> Any:
        tenant = self._tenant(request)
        body = decode_json(await read_body(request, self.args.max_body_bytes), GenerateBody)
        check_rid(body.rid)
        try:
            sampling = SamplingParams(stop_token_ids=tuple(body.stop_token_ids))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "stop_token_ids", "invalid_value") from None
        req, rid = self._request(tenant, body.input_ids, body.max_new_tokens, sampling,
                                 body.cache_salt, body.extra_key, body.rid)
        with self.admission.place(tenant.name):
            out = await self._complete(req)
        self.guard.served(tenant, out)
        cached = dict(out.cached_tokens) if tenant.admin else \
            {"total": sum(out.cached_tokens.values())}
        return _json(200, {"rid": rid, "output_ids": out.output_ids,
                           "num_prompt_tokens": out.num_prompt_tokens, "cached_tokens": cached,
                           "ttft_ms": round(out.ttft_s * 1e3, 3),
                           "latency_ms": round(out.latency_s * 1e3, 3)})

    async def _openai(self, request: Any, *, chat: bool) -> Any:
        hops = {"received_ns": time.time_ns()}   # the overhead breakdown's clock stamps
        tenant = self._tenant(request)
        kind = openai.ChatRequest if chat else openai.CompletionRequest
        raw = await read_body(request, self.args.max_body_bytes)
        hops["body_ns"] = time.time_ns()
        body = decode_json(raw, kind)
        check_rid(body.rid)
        if body.model != self.model:
            raise HTTPError(404, f"model {body.model!r} is not served here; this server "
                                 f"serves {self.model!r}", "model", "model_not_found")
        ids = self._prompt_ids(body, chat)
        sampling = self._sampling(body)
        req, _ = self._request(tenant, ids, body.new_tokens, sampling, body.cache_salt,
                               body.extra_key, body.rid, openai.client_names(body, chat),
                               body.pin_ttl_s)
        await self.pins.admit(tenant, req)   # a pin over a limit: 400 before any work
        rid = openai.request_id(chat)
        if body.stream:
            hops["admitted_ns"] = time.time_ns()
            return self._sse(req, rid, chat, tenant, body.include_usage, hops)
        with self.admission.place(tenant.name):
            out = await self._complete(req)
        self.guard.served(tenant, out)
        text = self.tokenizer.decode(out.output_ids)
        return _json(200, openai.answer(rid, self.model, chat, text, out, tenant.admin,
                                        req.sampling.stop_token_ids))

    # -- helpers -------------------------------------------------------------------------

    def _admin(self, request: Any, what: str) -> None:
        """403 unless the request's key is an admin key."""
        if not self._tenant(request).admin:
            raise HTTPError(403, f"{what} needs an admin key", "authorization",
                            "permission_denied")

    def _tenant(self, request: Any) -> Tenant:
        if self.tenants is None:
            return OPEN
        try:
            return self.tenants.tenant(request.headers.get("authorization"))
        except Unauthorized as exc:
            raise HTTPError(401, str(exc), "authorization", "invalid_api_key") from None

    def _prompt_ids(self, body: Any, chat: bool) -> list[int]:
        try:
            if chat:
                return self.tokenizer.chat(body.messages)
            return body.prompt if isinstance(body.prompt, list) else \
                self.tokenizer.encode(body.prompt)
        except ValueError as exc:
            raise value_error(exc) from None

    def _sampling(self, body: Any) -> SamplingParams:
        """The body's sampling; the answer ends at the model's end-of-sequence ids (unless
        ``ignore_eos``) and at the body's ``stop_token_ids``."""
        vocab = self.cluster.pd.model.vocab_size
        eos = () if body.ignore_eos else tuple(t for t in self.tokenizer.eos_ids if t < vocab)
        try:
            return SamplingParams(temperature=body.temperature, seed=body.seed or 0,
                                  stop_token_ids=eos + tuple(body.stop_token_ids or ()))
        except ValueError as exc:
            field = str(exc).split(":", 1)[0].removeprefix("sampling.")
            raise HTTPError(400, str(exc), field, "invalid_value") from None

    def _request(self, tenant: Tenant, ids: list[int], max_new: int, sampling: SamplingParams,
                 salt: str | None, extra_key: str | None, rid: str | None,
                 names: Mapping[str, str] | None = None, pin_ttl_s: float = 0.0
                 ) -> tuple[Req, str]:
        """The checked ``Req``; its namespace salt is the tenant's when keys are on. A
        refusal names the field as ``names`` say the client's body called it."""
        self.guard.admit(tenant, len(ids) + max_new)   # the key's rate limits: 429
        tag = secrets.token_hex(8)
        shown = rid if rid is not None else f"http-{tag}"
        if self.tenants is not None:
            salt = self.tenants.cache_salt(tenant, salt)
        # NOTE: the cluster keys slots and locks by rid, so two clients reusing one rid
        # must not collide, nor two ingress replicas: the internal rid is random (no count
        # a tenant could read others' traffic from), the reply echoes the client's. The
        # deadline starts here, when the ingress has the request: Serve hands over no
        # arrival time, so time spent in Serve's own queues is not counted.
        fields = {"rid": shown if rid is None else f"{rid}#{tag}", "input_ids": ids,
                  "max_new_tokens": max_new,
                  "sampling": sampling, "cache_salt": salt, "extra_key": extra_key,
                  "deadline": time.time() + self.args.request_timeout_s,
                  "tenant": tenant.name, "pin_ttl_s": pin_ttl_s}
        try:
            return self.cluster.admit(fields), shown
        except ValueError as exc:
            raise value_error(exc, names) from None

    async def _complete(self, req: Req) -> Completion:
        try:
            return await asyncio.wait_for(self.cluster.generate_async(req),
                                          self.args.request_timeout_s)
        except ValueError as exc:
            raise value_error(exc) from None
        except Exception as exc:  # noqa: BLE001  (a dead worker, a deadline, a failed task)
            raise unavailable(req, exc) from None

    def _sse(self, req: Req, rid: str, chat: bool, tenant: Tenant, with_usage: bool,
             hops: dict[str, int]) -> Any:
        from starlette.responses import StreamingResponse

        place = self.admission.place(tenant.name)   # 429 before the stream; held to its end
        # NOTE: the prefill starts now, while Serve sets the response up, not once it first
        # asks the body for a chunk (a body never read leaves it unanswered: no decode).
        items = self.cluster.stream(req)
        first = asyncio.ensure_future(anext(items))
        return StreamingResponse(self._events(req, rid, chat, tenant, with_usage, place, hops,
                                              primed(first, items)),
                                 media_type="text/event-stream")

    async def _events(self, req: Req, rid: str, chat: bool, tenant: Tenant, with_usage: bool,
                      place: Place, hops: dict[str, int],
                      items: AsyncIterator[int | Completion]) -> AsyncIterator[str]:
        chunks, text = openai.Chunks(rid, self.model, chat), self.tokenizer.stream()
        with place:
            try:
                async for item in items:
                    if isinstance(item, Completion):
                        self.guard.served(tenant, item)
                        yield chunks.token(text.flush(), None, openai.finish_reason(
                            item, req.sampling.stop_token_ids))
                        if with_usage:
                            yield chunks.usage(item, tenant.admin, hops)
                    else:
                        if "first_token_ns" not in hops:   # the overhead breakdown's
                            hops["first_token_ns"] = time.time_ns()
                        yield chunks.token(text.feed(item), item)
            except Exception as exc:  # noqa: BLE001 - the stream ends with an error event
                yield openai.error_event(unavailable(req, exc).body())
            yield openai.DONE

    def __del__(self) -> None:
        # Serve calls this when the replica shuts down. An unnamed cluster's actors go with
        # it; a named one's stay for the next replica (`pd-cache serve` removes them at exit).
        cluster = getattr(self, "cluster", None)
        if cluster is not None and self.args.cluster_name is None:
            cluster.shutdown(check=False)


def app_builder(args: Mapping[str, Any] | None = None) -> Any:
    """The Serve application of a config's ``args``; ``ValueError`` naming a bad arg."""
    parsed = AppArgs.parse(args)   # bad args fail here, before any actor
    return PDCacheIngress.options(num_replicas=parsed.ingress.ingress_replicas).bind(parsed)


app = app_builder

__all__ = ["AppArgs", "GenerateBody", "IngressConfig", "PDCacheIngress", "app", "app_builder"]
