"""``HTTPTarget(text_prompts=True)`` against a strict server on loopback: a server that, like
``transformers serve``, takes only a text prompt and OpenAI's own fields (422 otherwise)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from pd_cache.app.bench.targets import (
    HTTPTarget,
    Reply,
    TargetError,
    Tokens,
    ids_to_text,
    text_to_ids,
)
from pd_cache.app.bench.workloads import BenchRequest, Segment

SEEN = web.AppKey("seen", list)
OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options"}


def test_text_round_trips_ids_below_95_and_keeps_length_of_foreign_characters() -> None:
    ids = list(range(95)) * 2
    assert text_to_ids(ids_to_text(ids)) == ids
    assert ids_to_text([95, 96]) == ids_to_text([0, 1])
    assert all(32 <= ord(c) < 127 for c in ids_to_text(range(500)))
    assert text_to_ids("a\né") == [ord("a") - 32, 0, 0]


async def _strict(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    unexpected = set(body) - OPENAI_FIELDS
    if unexpected or not isinstance(body.get("prompt"), str):
        return web.json_response({"detail": f"Unexpected fields: {sorted(unexpected)}"},
                                 status=422)
    request.app[SEEN].append(body)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    answer = body["prompt"][::-1][:body["max_tokens"]]
    for ch in answer:
        await resp.write(f"data: {json.dumps({'choices': [{'text': ch}]})}\n\n".encode())
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(answer)}
    await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _stream(target: HTTPTarget, spec: BenchRequest, ids: list[int]) -> list[Any]:
    return [item async for item in target.stream(spec, ids)]


def test_text_mode_sends_only_openai_fields_and_reads_the_answer_back_from_its_text() -> None:
    async def go() -> tuple[list[Any], list[dict[str, Any]], str]:
        app = web.Application()
        app[SEEN] = []
        app.router.add_post("/v1/completions", _strict)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        spec = BenchRequest(index=0, tenant=1, session="s", turn=0,
                            segments=(Segment(tokens=(1, 2, 3)),), max_tokens=2,
                            cache_salt="tenant-1", extra_key="adapter-1")
        try:
            plain = HTTPTarget(url, model="m")
            with pytest.raises(TargetError) as refused:
                await _stream(plain, spec, [40, 41, 42])
            await plain.close()
            text = HTTPTarget(url, model="m", text_prompts=True)
            items = await _stream(text, spec, [40, 41, 42])
            await text.close()
        finally:
            await runner.cleanup()
        return items, app[SEEN], refused.value.kind

    items, seen, refused = asyncio.run(go())
    assert refused == "HTTP422"
    assert seen == [{"model": "m", "prompt": ids_to_text([40, 41, 42]), "max_tokens": 2,
                     "temperature": 0.0, "stream": True,
                     "stream_options": {"include_usage": True}}]
    assert items[:2] == [Tokens(1), Tokens(1)]
    reply = items[-1]
    assert isinstance(reply, Reply)
    assert reply.output_ids == [42, 41] and reply.prompt_tokens == 3
