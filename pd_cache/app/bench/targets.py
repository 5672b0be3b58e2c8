"""Where ``pd-cache bench`` sends its requests: an in-process ``PDCluster`` or any
OpenAI-compatible server over HTTP.

A target streams one request: each token (or chunk of tokens) as it arrives, then a
``Reply`` with what the server said about the request (cached tokens, by tier when it tells).
Both measure on the client side: the runner stamps each item's arrival.

    LocalTarget(cluster)   PDCluster.stream: no HTTP; cached tokens by tier, workers and
                           cross-namespace hits come from the ``Completion``
    HTTPTarget(url)        POST {url}/v1/completions, token ids in, stream: true, usage
                           included; pd-cache's ``token_ids`` extension carries the answer's
                           ids, and an admin key adds the cached tokens by tier
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

DROP_ROUTE = "/admin/drop_caches"
# NOTE: text mode writes id i as the printable ASCII character 32 + i % 95 and reads an
# answer's characters back the same way, so a later turn embeds the answer's own text. With
# a byte-level tokenizer without merges (`make-checkpoint --vocab-size 259`) one character
# is one token, and both servers tokenize the same text the same way.
_FIRST_PRINTABLE, _PRINTABLE = 32, 95


def ids_to_text(ids: Sequence[int]) -> str:
    """The prompt text that stands for ``ids`` in text mode."""
    return "".join(chr(_FIRST_PRINTABLE + i % _PRINTABLE) for i in ids)


def text_to_ids(text: str) -> list[int]:
    """The ids whose ``ids_to_text`` is ``text`` (a character outside the printable ASCII
    range counts as id 0: its length is kept, not its value)."""
    return [o - _FIRST_PRINTABLE if 0 <= o - _FIRST_PRINTABLE < _PRINTABLE else 0
            for o in map(ord, text)]


class Reply(NamedTuple):
    """What the server said about one finished request (``None``: it did not say)."""

    output_ids: list[int]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    tier_hits: dict[str, int] | None = None
    cross_namespace_tokens: int | None = None
    prefill_worker: int | None = None
    decode_worker: int | None = None
    attempts: int | None = None


class Tokens(NamedTuple):
    """Tokens that arrived together (one SSE chunk, or one token of ``PDCluster.stream``)."""

    count: int


class TargetError(RuntimeError):
    """The server refused or failed the request; ``kind`` names the error (``HTTP503``,
    ``WorkerDied``, ...), the message is the server's."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class LocalTarget:
    """An in-process ``PDCluster``; ``name`` labels it in results.

    ``completions``: the cluster's own ``Completion`` of each request, by request index
    (the latest run's; phase timings and handoffs a ``Reply`` does not carry).
    ``stream=False`` asks for whole answers (``PDCluster.generate_async``, no per-token
    calls): every token then arrives with the last, so a record's TTFT is its E2EL and the
    cluster's own TTFT is in ``completions``.
    """

    name = "local"

    def __init__(self, cluster: Any, *, stream: bool = True) -> None:
        self.cluster, self.streaming = cluster, stream
        self.completions: dict[int, Any] = {}

    async def stream(self, spec: Any, prompt_ids: list[int]) -> AsyncIterator[Tokens | Reply]:
        from pd_cache.core.request import Req
        from pd_cache.core.wire import Completion

        req = Req(rid=f"bench-{spec.index}", input_ids=prompt_ids,
                  max_new_tokens=spec.max_tokens, cache_salt=spec.cache_salt,
                  extra_key=spec.extra_key)
        if not self.streaming:
            out = await self.cluster.generate_async(req)
            self.completions[spec.index] = out
            yield Tokens(len(out.output_ids))
            yield _reply(out)
            return
        async for item in self.cluster.stream(req):
            if isinstance(item, Completion):
                self.completions[spec.index] = item
                yield _reply(item)
            else:
                yield Tokens(1)

    async def drop_caches(self) -> dict[str, int]:
        return await asyncio.to_thread(self.cluster.drop_caches)

    async def close(self) -> None:
        return None


def _reply(out: Any) -> Reply:
    return Reply(list(out.output_ids), out.num_prompt_tokens, sum(out.cached_tokens.values()),
                 dict(out.cached_tokens), out.cross_namespace_tokens, out.prefill_worker,
                 out.decode_worker, out.attempts)


class HTTPTarget:
    """Any OpenAI-compatible server at ``url`` (its base, without ``/v1``).

    ``api_keys``: none, one for every tenant, or one per tenant (tenant ``t`` uses
    ``api_keys[t % len]``); ``admin_key`` (default: tenant 0's) empties the caches.
    ``model``: the served model's name (default: the first that
    ``/v1/models`` lists). Requests are completions with token-id prompts, greedy, streamed
    with usage; ``cache_salt`` (vLLM) and ``extra_key`` (SGLang) name the namespace, and
    ``ignore_eos`` keeps every answer at its requested length. ``text_prompts``: the prompt
    goes as text (``ids_to_text``), the body carries only OpenAI's own fields, and the
    answer's ids are read back from its text; the server's own length controls then decide
    the length (a checkpoint that never draws its end-of-sequence id keeps answers equal).
    """

    def __init__(self, url: str, *, api_keys: Sequence[str] = (), model: str | None = None,
                 timeout_s: float = 600.0, drop_route: str | None = DROP_ROUTE,
                 admin_key: str | None = None, text_prompts: bool = False) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"target: expected 'local' or an http(s) URL, got {url!r}")
        self.url, self.name = url.rstrip("/"), url.rstrip("/")
        self.api_keys, self.model = list(api_keys), model
        self.timeout_s, self.drop_route, self.admin_key = timeout_s, drop_route, admin_key
        self.text_prompts = text_prompts
        self._session: Any = None

    async def _http(self) -> Any:
        import aiohttp

        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            # NOTE: no connection cap beyond the runner's own concurrency bound.
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    def _headers(self, tenant: int = 0) -> dict[str, str]:
        if not self.api_keys:
            return {}
        return {"Authorization": f"Bearer {self.api_keys[tenant % len(self.api_keys)]}"}

    async def served_model(self) -> str:
        """``model``, else the first model ``GET /v1/models`` lists."""
        if self.model is None:
            http = await self._http()
            async with http.get(f"{self.url}/v1/models", headers=self._headers()) as resp:
                body = await _json_or_error(resp, "/v1/models")
            models = body.get("data") or []
            if not models:
                raise TargetError("NoModel", f"{self.url}/v1/models lists no model")
            self.model = models[0]["id"]
        return self.model

    async def stream(self, spec: Any, prompt_ids: list[int]) -> AsyncIterator[Tokens | Reply]:
        body = self._body(spec, prompt_ids, await self.served_model())
        http = await self._http()
        ids: list[int] = []
        text: list[str] = []
        count, usage, details = 0, None, None
        async with http.post(f"{self.url}/v1/completions", json=body,
                             headers=self._headers(spec.tenant)) as resp:
            if resp.status != 200:
                await _json_or_error(resp, "/v1/completions")
            async for event in _events(resp):
                if "error" in event:
                    err = event["error"]
                    raise TargetError(str(err.get("type") or "error"), str(err.get("message")))
                for choice in event.get("choices") or []:
                    new = choice.get("token_ids")
                    n = len(new) if new is not None else int(bool(choice.get("text")))
                    ids += new or []
                    text.append(choice.get("text") or "")
                    if n:
                        count += n
                        yield Tokens(n)
                usage = event.get("usage") or usage
                details = event.get("pd_cache") or details
        if self.text_prompts:
            ids = text_to_ids("".join(text))
        yield _http_reply(ids, count, usage, details)

    def _body(self, spec: Any, prompt_ids: list[int], model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
        if self.text_prompts:
            body["prompt"] = ids_to_text(prompt_ids)
            return body
        body.update(prompt=prompt_ids, ignore_eos=True, return_token_ids=True)
        if spec.cache_salt is not None:
            body["cache_salt"] = spec.cache_salt
        if spec.extra_key is not None:
            body["extra_key"] = spec.extra_key
        return body

    async def drop_caches(self) -> dict[str, int]:
        """``POST {url}{drop_route}`` (pd-cache: ``/admin/drop_caches`` with an admin key;
        vLLM: ``/reset_prefix_cache``; SGLang: ``/flush_cache``); with no route, nothing."""
        if self.drop_route is None:
            return {}
        http = await self._http()
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key \
            else self._headers()
        async with http.post(f"{self.url}{self.drop_route}", headers=headers) as resp:
            if resp.status >= 300:
                await _json_or_error(resp, self.drop_route)
            text = await resp.text()
        try:
            return dict(json.loads(text).get("dropped_pages") or {})
        except (ValueError, AttributeError):
            return {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _http_reply(ids: list[int], count: int, usage: dict | None, details: dict | None) -> Reply:
    # NOTE: a server that does not return token ids still says how many it sent; the ids
    # then stand in as a run of zeros of that length (a later turn embeds an answer of the
    # right length, not its text).
    if not ids and count:
        ids = [0] * int((usage or {}).get("completion_tokens") or count)
    prompt = cached = None
    if usage:
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    details = details or {}
    tiers = details.get("cached_tokens")
    return Reply(ids, prompt, cached, dict(tiers) if isinstance(tiers, dict) else None,
                 details.get("cross_namespace_tokens"), details.get("prefill_worker"),
                 details.get("decode_worker"), details.get("attempts"))


async def _events(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON bodies of a Server-Sent Events stream, up to ``data: [DONE]``."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise TargetError("BadStream", f"not JSON in the event stream: {data[:200]!r}") \
                from None


async def _json_or_error(resp: Any, route: str) -> dict[str, Any]:
    """The JSON body of a 2xx answer; ``TargetError("HTTP<status>", message)`` otherwise."""
    text = await resp.text()
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if resp.status >= 300:
        message = text[:500]
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message", message))
        raise TargetError(f"HTTP{resp.status}", f"{route}: {message}")
    if not isinstance(body, dict):
        raise TargetError("BadAnswer", f"{route}: expected a JSON object, got {text[:200]!r}")
    return body
