"""The OpenAI-compatible API: request bodies, answers and stream chunks.

``POST /v1/completions`` (``prompt``: text or token ids) and ``POST /v1/chat/completions``
(``messages`` through the model's chat template) take ``model``, ``max_tokens`` (16),
``temperature`` (0-2), ``seed``, ``stream``, ``stream_options.include_usage`` and ``user``, plus
the extensions ``extra_key`` (the adapter namespace, as in SGLang), ``cache_salt`` (as in
vLLM; with API keys it only subdivides the caller's tenant), and, as in vLLM,
``stop_token_ids`` (more ids that end the answer) and ``ignore_eos`` (do not stop at the
checkpoint's end-of-sequence ids, which end an answer by default: ``finish_reason`` is then
``stop``). ``top_p``, ``presence_penalty`` and ``frequency_penalty`` are checked against
OpenAI's ranges and not applied; ``n`` must be 1. Other fields OpenAI clients send that do
not apply here are ignored. A body may pin its prompt's pages (``pd_cache.front.pinning``):
the extension ``"pd_cache": {"pin_ttl_s": N}``, or OpenAI's ``prompt_cache_retention``
(``"24h"``: a 24 h pin; ``"in_memory"``: none). Answers carry the
generated token ids (``token_ids``, an extension) and
``usage.prompt_tokens_details.cached_tokens``; admin keys also get ``pd_cache`` (cached
tokens by tier, server timings, workers).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any, Literal

import msgspec

from pd_cache.core.pins import RETENTION_TTL_S
from pd_cache.core.wire import Completion


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Extension(msgspec.Struct, forbid_unknown_fields=True):
    """pd-cache's own request options (``"pd_cache": {...}``)."""

    pin_ttl_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


# NOTE: OpenAI's ranges, checked at decoding so a refusal names the field the client sent.
Tokens = Annotated[int, msgspec.Meta(ge=0)]
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
Unit = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    temperature: Temperature = 0.0
    seed: int | None = None
    # accepted within OpenAI's ranges, not applied (sampling here is by temperature alone)
    top_p: Unit | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None
    rid: str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    pd_cache: Extension | None = None
    # NOTE: OpenAI's values; "in-memory" is how its SDKs spelled "in_memory" at first.
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None

    @property
    def pin_ttl_s(self) -> float:
        """Seconds to pin the prompt for: the longer of the extension's and the retention's."""
        own = 0.0 if self.pd_cache is None else self.pd_cache.pin_ttl_s
        return max(own, RETENTION_TTL_S.get(self.prompt_cache_retention or "", 0.0))

    @property
    def new_tokens(self) -> int:
        chosen = self.max_completion_tokens if self.max_tokens is None else self.max_tokens
        return 16 if chosen is None else chosen

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def client_names(body: _Common, chat: bool) -> dict[str, str]:
    """pd-cache's field names in a refusal (patterns) as this body names them: the prompt
    is ``prompt`` or (a token's index meaning nothing there) ``messages``; the answer's
    length the one of ``max_tokens`` / ``max_completion_tokens`` the client set."""
    tokens = "max_completion_tokens" if body.max_tokens is None \
        and body.max_completion_tokens is not None else "max_tokens"
    prompt = {r"input_ids(\[\d+\])?": "messages"} if chat else {r"input_ids": "prompt"}
    return {**prompt, r"max_new_tokens": tokens, r"sampling\.": ""}


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]


def request_id(chat: bool) -> str:
    """A random id: no count of the requests before it (other tenants' included)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"


def usage(out: Completion) -> dict[str, Any]:
    cached = sum(out.cached_tokens.values())
    completion = len(out.output_ids)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": out.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def details(out: Completion, hops: dict[str, int] | None = None) -> dict[str, Any]:
    """What only admin keys see: cached tokens by tier, timings, the workers used.
    ``ttft_ms``: the cluster's, from routing to the prefill worker's answer; ``prefill_ms``:
    the worker's own part of it. ``hops`` (streams): ``received_ns``, ``body_ns``,
    ``admitted_ns`` and ``first_token_ns``, ``time.time_ns()`` when the ingress got the
    request, had its body, had admitted it and handed on its first token, so a client on the
    same machine can split its TTFT by hop."""
    body = {"cached_tokens": dict(out.cached_tokens), "ttft_ms": round(out.ttft_s * 1e3, 3),
            "prefill_ms": round(out.prefill_s * 1e3, 3),
            "latency_ms": round(out.latency_s * 1e3, 3), "prefill_worker": out.prefill_worker,
            "decode_worker": out.decode_worker, "attempts": out.attempts,
            "cross_namespace_tokens": out.cross_namespace_tokens}
    return body | hops if hops else body


def answer(rid: str, model: str, chat: bool, text: str, out: Completion, admin: bool,
           stops: tuple[int, ...] = ()) -> dict[str, Any]:
    """The whole answer of a request that did not stream (``stops``: its stop token ids)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(out, stops),
                              "token_ids": list(out.output_ids)}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(out)}
    if admin:
        body["pd_cache"] = details(out)
    return body


def finish_reason(out: Completion, stops: tuple[int, ...] = ()) -> str:
    """``stop`` when the answer ended on one of ``stops``, else ``length``."""
    return "stop" if out.output_ids and out.output_ids[-1] in stops else "length"


class Chunks:
    """Server-Sent Events of one streamed answer: a chunk per token, ``data: [DONE]``."""

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.rid, self.model, self.chat = rid, model, chat
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self._first = True

    def token(self, text: str, token: int | None, finish: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                                  "token_ids": [] if token is None else [token]}
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if self._first:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = text
        self._first = False
        return self._event({"choices": [choice]})

    def usage(self, out: Completion, admin: bool, hops: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {"choices": [], "usage": usage(out)}
        if admin:
            body["pd_cache"] = details(out, hops)
        return self._event(body)

    def _event(self, body: dict[str, Any]) -> str:
        full = {"id": self.rid, "object": self.object, "created": self.created,
                "model": self.model, **body}
        return f"data: {json.dumps(full, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
