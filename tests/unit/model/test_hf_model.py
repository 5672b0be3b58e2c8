"""A Hugging Face checkpoint through the engine: its forward equals ``transformers``' own,
over a cached prefix as over the whole sequence, and every cached path of ``LocalEngine``
(radix hit, L3 prefetch on a fresh engine, second turn) decodes what ``transformers``
decodes with no cache at all. Bad checkpoints are refused naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch

from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.request import Req
from pd_cache.model.digest import with_weights_digest
from pd_cache.model.hf_model import HFModel, build_model
from pd_cache.model.model import Model
from pd_cache.storage import make_backend
from pd_cache.worker.engine import LocalEngine
from tests.hf_checkpoints import assert_matches, hf_generate, hf_logits

pytest.importorskip("transformers")
ARCHS = ["llama", "qwen2"]
PS = 4


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_equals_transformers_at_every_position(hf_checkpoints, arch: str) -> None:
    cfg = ModelConfig.from_pretrained(hf_checkpoints[arch])
    ids = tokens(1, 48, cfg.vocab_size)
    ours = HFModel(cfg)(ids, all_logits=True).logits
    theirs = hf_logits(hf_checkpoints[arch], ids)
    assert ours.shape == theirs.shape == (48, cfg.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    assert bool((ours.argmax(-1) == theirs.argmax(-1)).all())


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_over_a_cached_prefix_equals_the_whole_forward(hf_checkpoints, arch) -> None:
    model = build_model(ModelConfig.from_pretrained(hf_checkpoints[arch]))
    assert isinstance(model, HFModel)
    ids = tokens(2, 40, model.cfg.vocab_size)
    whole = model(ids, all_logits=True)
    head = model(ids[:25])
    tail = model(ids[25:], head.kv, all_logits=True)
    torch.testing.assert_close(tail.logits, whole.logits[25:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([head.kv, tail.kv], dim=2), whole.kv)
    # decode_step: one token after the prefix, written in place into a private buffer
    buf = torch.zeros(2, model.cfg.num_layers, 41, model.cfg.num_kv_heads, model.cfg.head_dim)
    buf[:, :, :39] = whole.kv[:, :, :39]
    step = model.decode_step([ids[39]], [buf], [39])
    # NOTE: a step's kernels (one row's products, decode's attention) round differently
    # from a prompt's: by up to 2e-5 here on an AVX-512 CPU; a wrong position or KV row
    # moves logits by tenths.
    torch.testing.assert_close(step[0], whole.logits[39], atol=5e-5, rtol=1e-4)
    assert int(step[0].argmax()) == int(whole.logits[39].argmax())
    torch.testing.assert_close(buf[:, :, 39], whole.kv[:, :, 39])


def config(path: str, storage: StorageConfig | None = None) -> PDCacheConfig:
    return PDCacheConfig(model=ModelConfig.from_pretrained(path),
                         cache=CacheConfig(page_size=PS, device_pages=32, host_pages=64),
                         storage=storage or StorageConfig())


@pytest.mark.parametrize("arch", ARCHS)
def test_local_engine_decodes_what_transformers_decodes(hf_checkpoints, arch: str) -> None:
    path = hf_checkpoints[arch]
    cfg = config(path)
    backend = make_backend(cfg.storage, cfg.layout)
    first, second = LocalEngine(cfg, storage=backend), LocalEngine(cfg, storage=backend)
    system = tokens(3, 18, cfg.model.vocab_size)
    turn1 = Req(rid="t1", input_ids=system + tokens(4, 7, cfg.model.vocab_size),
                max_new_tokens=10)
    out1 = first.generate(turn1)
    assert_matches(out1.output_ids, hf_generate(path, turn1.input_ids, 10))
    again = first.generate(Req(rid="t1b", input_ids=turn1.input_ids, max_new_tokens=10))
    assert again.cached_tokens["device"] == 24 and again.output_ids == out1.output_ids
    assert first.flush(10)
    # a fresh engine: turn 2 (turn 1, its answer, a new question) prefetched from L3
    turn2 = Req(rid="t2", input_ids=turn1.input_ids + out1.output_ids
                + tokens(5, 5, cfg.model.vocab_size), max_new_tokens=8)
    out2 = second.generate(turn2)
    assert out2.cached_tokens["storage"] == PS * ((25 + 10 - 1) // PS)
    assert_matches(out2.output_ids, hf_generate(path, turn2.input_ids, 8))
    for engine in (first, second):
        assert engine.locks_held() == 0
        engine.close()


def test_two_checkpoints_of_one_shape_share_no_l3_pages(hf_checkpoints, tmp_path) -> None:
    disk = StorageConfig(backend="disk", disk_path=str(tmp_path))
    a, b = config(hf_checkpoints["llama"], disk), config(hf_checkpoints["llama-b"], disk)
    assert a.layout.page_shape == b.layout.page_shape
    assert a.layout.fingerprint != b.layout.fingerprint
    ids = tokens(6, 22, a.model.vocab_size)
    served = []
    for cfg in (a, b, a):
        engine = LocalEngine(cfg, storage=make_backend(cfg.storage, cfg.layout))
        served.append(engine.generate(Req(rid="r", input_ids=ids, max_new_tokens=4)))
        assert engine.flush(10)
        engine.close()
    assert [s.cached_tokens["storage"] for s in served] == [0, 0, 20]
    for cfg, out in zip((a, b, a), served):
        assert_matches(out.output_ids, hf_generate(cfg.model.checkpoint, ids, 4))


def test_the_pinned_digest_is_the_checkpoints_and_changed_files_are_refused(
        hf_checkpoints, tmp_path) -> None:
    path = shutil.copytree(hf_checkpoints["llama"], tmp_path / "ck")
    cfg = ModelConfig.from_pretrained(str(path))
    pinned = with_weights_digest(PDCacheConfig(model=cfg))
    assert pinned.model == cfg   # from_pretrained already pinned the files' digest
    assert cfg.weights_digest == ModelConfig.from_pretrained(hf_checkpoints["llama"]).weights_digest
    shutil.copy(os.path.join(hf_checkpoints["llama-b"], "model.safetensors"), path)
    with pytest.raises(ValueError, match="model.weights_digest"):
        HFModel(cfg)
    with pytest.raises(ValueError, match="model.weights_digest"):
        LocalEngine(PDCacheConfig(model=cfg))


def _edit_config(src: str, dst, **changes) -> str:
    path = shutil.copytree(src, dst)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **changes}))
    return str(path)


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["MistralForCausalLM"]}, "architecture 'MistralForCausalLM' is not "
                                                "supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope type 'llama3'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_hidden_layers": None}, "missing 'num_hidden_layers'"),
])
def test_unsupported_checkpoints_are_refused_naming_why(hf_checkpoints, tmp_path, changes,
                                                        match) -> None:
    path = _edit_config(hf_checkpoints["llama"], tmp_path / "ck", **changes)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="model: .*" + match):
        ClusterConfig(model=path)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"])
def test_a_missing_file_is_an_error_naming_it(hf_checkpoints, tmp_path, missing) -> None:
    path = shutil.copytree(hf_checkpoints["qwen2"], tmp_path / "ck")
    os.remove(path / missing)
    with pytest.raises(ValueError, match="safetensors" if missing.endswith("safetensors")
                       else missing):
        ClusterConfig(model=str(path))


def test_a_checkpoint_with_a_tensor_too_many_or_too_few_is_refused(hf_checkpoints) -> None:
    cfg = ModelConfig.from_pretrained(hf_checkpoints["llama"])
    with pytest.raises(ValueError, match="no tensor 'model.layers.2"):
        HFModel(dataclasses.replace(cfg, num_layers=3))
    with pytest.raises(ValueError, match="does not use, such as 'model.layers.1"):
        HFModel(dataclasses.replace(cfg, num_layers=1))
    with pytest.raises(ValueError, match="has shape"):
        HFModel(dataclasses.replace(cfg, intermediate_size=64))


def test_cluster_config_takes_a_directory_beside_the_presets(hf_checkpoints) -> None:
    cfg = ClusterConfig(model=hf_checkpoints["qwen2"]).pd_config.model
    assert (cfg.architecture, cfg.attention_bias, cfg.tie_embeddings) == \
        ("Qwen2ForCausalLM", True, True)
    assert (cfg.vocab_size, cfg.max_context) == (320, 1024)
    assert ClusterConfig(model="tiny").pd_config.model == ModelConfig.preset("tiny")
    assert not isinstance(build_model(ModelConfig.preset("tiny")), HFModel)
    assert isinstance(build_model(ModelConfig.preset("tiny")), Model)
    with pytest.raises(ValueError, match="neither a preset"):
        ClusterConfig(model="huge")
