"""Hugging Face checkpoints (a tiny Llama, a tiny Qwen2) through a PDCluster and the OpenAI
front: every path (radix hit, L3 prefetch on a fresh worker, handoff, decode offload,
second turn) decodes what ``transformers`` decodes with no cache, token by token; tenants
share no pages; two checkpoints of one shape share no L3 pages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req
from pd_cache.front.hf_tokenizer import HFTokenizer
from tests.hf_checkpoints import assert_matches, hf_generate
from tests.integration import clusters
from tests.integration.clusters import assert_idle, request

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

PS = 4


def small(path: str, **fields: Any) -> ClusterConfig:
    return ClusterConfig(**{"model": path, "page_size": PS, "num_prefill": 2, "num_decode": 1,
                            "num_storage": 1, "device_pages": 64, "host_pages": 128,
                            "storage_timeout_s": 10.0, **fields})


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_cluster(request: Any, ray_cluster: Any, hf_checkpoints) -> Iterator[tuple[str, PDCluster]]:
    path = hf_checkpoints[request.param]
    cluster = PDCluster.start(small(path))
    yield path, cluster
    cluster.shutdown(check=True)   # raises if any worker leaked a lock or a slot


def req(ids: list[int], max_new: int, salt: str | None = None) -> Req:
    return request(ids, (None, salt), max_new, prefix="hf")


def tokens(seed: int, n: int, vocab: int = 320) -> list[int]:
    return clusters.tokens(seed, n, vocab)


def test_every_cached_path_decodes_what_transformers_decodes(arch_cluster) -> None:
    path, cluster = arch_cluster
    turn1 = req(tokens(1, 25), 10, "tenant-a")
    out1 = cluster.generate(turn1, prefill_worker=0)
    assert_matches(out1.output_ids, hf_generate(path, turn1.input_ids, 10))
    assert out1.pages_handed_off == 7 and sum(out1.cached_tokens.values()) == 0
    radix = cluster.generate(req(turn1.input_ids, 10, "tenant-a"), prefill_worker=0)
    assert radix.cached_tokens["device"] == 24 and radix.output_ids == out1.output_ids
    cluster.flush()
    assert cluster.l3_writes()["offload"] > 0          # decode offloaded the answer's pages
    fresh = cluster.generate(req(turn1.input_ids, 10, "tenant-a"), prefill_worker=1)
    assert fresh.cached_tokens["storage"] == 24 and fresh.output_ids == out1.output_ids
    # turn 2 on the worker that never saw turn 1's answer: prefetched from L3
    turn2 = req(turn1.input_ids + out1.output_ids + tokens(2, 6), 8, "tenant-a")
    out2 = cluster.generate(turn2, prefill_worker=1)
    assert out2.cached_tokens["storage"] == PS * ((25 + 10 - 1) // PS) - 24
    assert out2.cached_tokens["device"] == 24
    assert_matches(out2.output_ids, hf_generate(path, turn2.input_ids, 8))
    assert all(c.cross_namespace_tokens == 0 for c in (out1, radix, fresh, out2))
    assert_idle(cluster)


def test_two_tenants_never_share_pages(arch_cluster) -> None:
    path, cluster = arch_cluster
    prompt = tokens(3, 18)
    a = cluster.generate(req(prompt, 5, "tenant-x"), prefill_worker=0)
    cluster.flush()
    b = cluster.generate(req(prompt, 5, "tenant-y"), prefill_worker=0)
    assert sum(b.cached_tokens.values()) == 0
    want = hf_generate(path, prompt, 5)
    assert_matches(a.output_ids, want)
    assert_matches(b.output_ids, want)
    names = [cluster.router_names(req(prompt, 5, s)) for s in ("tenant-x", "tenant-y")]
    assert set(names[0]).isdisjoint(names[1])
    assert cluster.l3_holds(names[1]) == 4   # b's own, written after
    assert_idle(cluster)


def test_two_checkpoints_of_one_shape_share_no_l3_pages(ray_cluster, hf_checkpoints,
                                                        tmp_path) -> None:
    disk = {"storage_backend": "disk", "disk_path": str(tmp_path), "num_prefill": 1}
    a, b = (small(hf_checkpoints[n], **disk) for n in ("llama", "llama-b"))
    assert a.pd_config.layout.page_shape == b.pd_config.layout.page_shape
    prompt = tokens(4, 22)
    served = []
    secret = bytes(range(32))   # one server secret: L3 keys that outlive each cluster
    for cfg in (a, b, a):   # each a fresh cluster over the same disk L3
        cluster = PDCluster.start(cfg, secret=secret)
        try:
            served.append(cluster.generate(req(prompt, 4)))
            cluster.flush()
        finally:
            cluster.shutdown(check=True)
    assert [s.cached_tokens["storage"] for s in served] == [0, 0, 20]
    for cfg, out in zip((a, b, a), served):
        assert_matches(out.output_ids, hf_generate(cfg.model, prompt, 4))


def test_the_openai_front_serves_text_and_chat_with_the_checkpoints_tokenizer(
        ray_cluster, hf_checkpoints, serve_url) -> None:
    openai = pytest.importorskip("openai")
    from tests.integration.serving import running_app

    path = hf_checkpoints["qwen2"]
    tok = HFTokenizer(path)
    args = {"model": path, "page_size": PS, "num_prefill": 1, "num_decode": 1,
            "num_storage": 1, "cluster_name": None}
    with running_app(serve_url, args, "pd-cache-hf") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [path]
        prompt = "The cache layer keeps the KV of every prompt"
        text = client.completions.create(model=path, prompt=prompt, max_tokens=6)
        want = hf_generate(path, tok.encode(prompt), 6)
        assert_matches(text.choices[0].model_extra["token_ids"], want)
        assert text.choices[0].text == tok.decode(text.choices[0].model_extra["token_ids"])
        messages = [{"role": "system", "content": "Be terse."},
                    {"role": "user", "content": "Hello! How are you today?"}]
        chat = client.chat.completions.create(model=path, messages=messages, max_tokens=6)
        ids = chat.choices[0].model_extra["token_ids"]
        assert_matches(ids, hf_generate(path, tok.chat(messages), 6))
        assert chat.choices[0].message.content == tok.decode(ids)
        parts = list(client.chat.completions.create(model=path, messages=messages,
                                                    max_tokens=6, stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts) == tok.decode(ids)
        again = client.chat.completions.create(model=path, messages=messages, max_tokens=6)
        assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_an_answer_ends_at_the_checkpoints_end_of_sequence_id(ray_cluster, hf_checkpoints,
                                                              tmp_path, serve_url) -> None:
    """A copy of the Qwen2 checkpoint whose generation config names as end-of-sequence the
    4th token its answer draws: the OpenAI front stops there (``finish_reason`` ``stop``),
    where ``transformers``' own ``generate`` stops, streamed or not; ``ignore_eos`` runs to
    ``max_tokens``; ``stop_token_ids`` adds ids of the client's own."""
    import json
    import shutil

    import torch

    openai = pytest.importorskip("openai")
    from tests.hf_checkpoints import hf_model
    from tests.integration.serving import running_app

    original = hf_checkpoints["qwen2"]
    tok = HFTokenizer(original)
    prompt = "The cache layer keeps the KV of every prompt"
    ids = tok.encode(prompt)
    free = hf_generate(original, ids, 10).tokens
    eos = free[3]
    assert eos not in free[:3]
    path = shutil.copytree(original, tmp_path / "qwen2-eos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with torch.no_grad():
        theirs = hf_model(original).generate(torch.tensor([ids]), max_new_tokens=10,
                                             do_sample=False, eos_token_id=eos,
                                             pad_token_id=0)[0, len(ids):].tolist()
    assert theirs == free[:4]
    args = {"model": str(path), "page_size": PS, "num_prefill": 1, "num_decode": 1,
            "num_storage": 1, "cluster_name": None}
    with running_app(serve_url, args, "pd-cache-hf-eos") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = str(path)
        out = client.completions.create(model=model, prompt=prompt, max_tokens=10)
        assert out.choices[0].model_extra["token_ids"] == theirs
        assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 4
        parts = list(client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                               stream=True))
        assert [t for p in parts for t in p.choices[0].model_extra["token_ids"]] == theirs
        assert parts[-1].choices[0].finish_reason == "stop"
        longer = client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                           extra_body={"ignore_eos": True})
        assert longer.choices[0].model_extra["token_ids"] == free
        assert longer.choices[0].finish_reason == "length"
        own = client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                        extra_body={"ignore_eos": True,
                                                    "stop_token_ids": [free[1]]})
        assert own.choices[0].model_extra["token_ids"] == free[:2]
        assert own.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
            client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                      extra_body={"stop_token_ids": [10 ** 6]})
