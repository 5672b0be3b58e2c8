"""The ingress's replica count and its ids: replicas share one named cluster, and no id a
client sees counts the requests before it. A stream's prefill starts before Serve reads the
body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pd_cache.front import openai
from pd_cache.front.app_args import AppArgs, IngressConfig


def test_one_replica_by_default_and_more_only_on_a_named_cluster() -> None:
    assert IngressConfig().ingress_replicas == 1
    assert AppArgs.parse({"ingress_replicas": 2}).ingress.ingress_replicas == 2  # "pd-cache"
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ValueError, match="args.ingress_replicas"):
            AppArgs.parse({"ingress_replicas": bad})
    with pytest.raises(ValueError, match="ingress_replicas: 3 replicas must share one named "
                                         "cluster; set cluster_name"):
        AppArgs.parse({"ingress_replicas": 3, "cluster_name": None})
    assert AppArgs.parse({"ingress_replicas": 1, "cluster_name": None}).ingress.cluster_name \
        is None


def test_the_replica_count_reaches_the_serve_deployment() -> None:
    pytest.importorskip("ray.serve")
    from pd_cache.front.serve import app_builder

    for n in (1, 2):
        deployment = app_builder({"model": "tiny", "ingress_replicas": n})._bound_deployment
        assert deployment.num_replicas == n
    with pytest.raises(ValueError, match="cluster_name"):
        app_builder({"ingress_replicas": 2, "cluster_name": None})


def gaps(ids: list[str], prefix: str) -> list[int]:
    """How far apart consecutive ids are, read as the hex numbers after ``prefix``."""
    numbers = [int(i.removeprefix(prefix), 16) for i in ids]
    return [abs(b - a) for a, b in zip(numbers, numbers[1:])]


def test_completion_ids_are_random() -> None:
    for chat, prefix in ((False, "cmpl-"), (True, "chatcmpl-")):
        ids = [openai.request_id(chat) for _ in range(50)]
        assert all(i.startswith(prefix) and len(i) == len(prefix) + 24 for i in ids)
        assert len(set(ids)) == 50
        # A counter (even behind a random prefix) puts consecutive ids 1 apart.
        assert min(gaps(ids, prefix)) > 1 << 32


class _Cluster:
    """Streams two tokens of a request once asked; records when it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def stream(self, req: Any) -> AsyncIterator[Any]:
        self.asked.append(req.rid)
        yield 7
        yield 8


def test_a_streams_prefill_starts_before_serve_reads_the_body() -> None:
    pytest.importorskip("ray.serve")
    from pd_cache.core.request import Req
    from pd_cache.front.flow import Admission
    from pd_cache.front.guard import TenantGuard
    from pd_cache.front.serve import OPEN, PDCacheIngress
    from pd_cache.front.tokenizer import ByteTokenizer

    cls = PDCacheIngress.func_or_class
    ingress = cls.__new__(cls)
    ingress.args, ingress.model = IngressConfig(), "m"
    ingress.admission = Admission(1)
    ingress.guard = TenantGuard(None, 1)
    ingress.cluster, ingress.tokenizer = _Cluster(), ByteTokenizer(512)

    async def run() -> list[str]:
        req = Req(rid="r", input_ids=[3, 4], max_new_tokens=2)
        body = ingress._sse(req, "cmpl-x", False, OPEN, False, {"received_ns": 0}).body_iterator
        await asyncio.sleep(0)
        assert ingress.cluster.asked == ["r"]   # before the first chunk is asked for
        assert ingress.admission.pending == 1
        chunks = [c async for c in body]
        assert ingress.admission.pending == 0
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) == 3 and chunks[-1] == openai.DONE   # two tokens, then [DONE]
