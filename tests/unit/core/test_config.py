"""Config: frozen, validated at construction, environment read in one place."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pd_cache.core.config import (
    KV_DTYPES,
    CacheConfig,
    ModelConfig,
    PDCacheConfig,
    StorageConfig,
)
from pd_cache.kv.pages import kv_torch_dtype


@pytest.mark.parametrize("build, field", [
    (lambda: ModelConfig(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (lambda: ModelConfig(vocab_size=0), "vocab_size"),
    (lambda: ModelConfig(kv_dtype="int8"), "kv_dtype"),
    (lambda: ModelConfig.preset("huge"), "model.name"),
    (lambda: CacheConfig(page_size=0), "page_size"),
    (lambda: CacheConfig(hash_algo="md5"), "hash_algo"),
    (lambda: CacheConfig(write_policy="sometimes"), "write_policy"),
    (lambda: StorageConfig(backend="s3"), "backend"),
    (lambda: StorageConfig(backend="disk"), "disk_path"),
    (lambda: StorageConfig(prefetch_policy="eager"), "prefetch_policy"),
    (lambda: StorageConfig(disk_reserve=-0.1), "disk_reserve"),
    (lambda: StorageConfig(disk_reserve=1.5), "disk_reserve"),
    (lambda: StorageConfig(disk_reserve=float("inf")), "disk_reserve"),
    (lambda: StorageConfig(prefetch_timeout_max_s=-1), "prefetch_timeout_max_s"),
    (lambda: StorageConfig(offload_min_pages=0), "offload_min_pages"),
    (lambda: StorageConfig(write_nice=20), "write_nice"),
    (lambda: StorageConfig(write_nice=-1), "write_nice"),
    (lambda: StorageConfig(write_nice=True), "write_nice"),
    (lambda: PDCacheConfig(model=ModelConfig(max_context=8), cache=CacheConfig(page_size=16)),
     "page_size"),
])
def test_invalid_values_raise_naming_the_field(build, field) -> None:
    with pytest.raises(ValueError, match=field):
        build()


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().page_size = 3  # type: ignore[misc]


def test_layout_fingerprint_separates_layouts() -> None:
    base = PDCacheConfig()
    prints = {
        base.layout.fingerprint,
        PDCacheConfig(cache=CacheConfig(page_size=32)).layout.fingerprint,
        PDCacheConfig(model=ModelConfig(kv_dtype="bfloat16")).layout.fingerprint,
        PDCacheConfig(model=ModelConfig.preset("small")).layout.fingerprint,
        dataclasses.replace(base.layout, tp_size=2, tp_rank=1).fingerprint,
    }
    assert len(prints) == 5
    assert PDCacheConfig().layout.fingerprint == base.layout.fingerprint
    assert base.layout.page_shape == (2, 2, 16, 2, 16)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_page_nbytes_is_what_a_page_tensor_of_the_layout_holds(kv_dtype: str) -> None:
    layout = PDCacheConfig(model=ModelConfig(kv_dtype=kv_dtype)).layout
    page = torch.zeros(layout.page_shape, dtype=kv_torch_dtype(kv_dtype))
    assert layout.page_nbytes == page.numel() * page.element_size()


def test_check_compatible() -> None:
    PDCacheConfig().check_compatible(PDCacheConfig(cache=CacheConfig(device_pages=4)))
    with pytest.raises(ValueError, match="layout"):
        PDCacheConfig().check_compatible(PDCacheConfig(cache=CacheConfig(page_size=8)))


def test_env_overrides() -> None:
    cfg = PDCacheConfig.from_env({"PD_CACHE_MODEL_NAME": "small",
                                  "PD_CACHE_CACHE_PAGE_SIZE": "32",
                                  "PD_CACHE_STORAGE_PREFIX_KEYS": "false",
                                  "PD_CACHE_STORAGE_PREFETCH_TIMEOUT_MAX_S": "0.5",
                                  "UNRELATED": "x"})
    assert cfg.model == ModelConfig.preset("small")
    assert cfg.cache.page_size == 32 and cfg.storage.prefix_keys is False
    assert cfg.storage.prefetch_timeout_max_s == 0.5
    with pytest.raises(ValueError, match="PD_CACHE_CACHE_PAGE_SIZE"):
        PDCacheConfig.from_env({"PD_CACHE_CACHE_PAGE_SIZE": "big"})
    with pytest.raises(ValueError, match="page_size"):
        PDCacheConfig.from_env({"PD_CACHE_CACHE_PAGE_SIZE": "0"})


# One value per ModelConfig field that differs from the default. A new field must be added
# here, and so decide whether it changes a page's bytes (see KV_NEUTRAL_FIELDS).
OTHER_VALUES = {
    "name": "tiny-ft", "vocab_size": 1024, "hidden_size": 128, "num_layers": 3,
    "num_heads": 8, "num_kv_heads": 4, "head_dim": 32, "intermediate_size": 256,
    "max_context": 2048, "rope_theta": 500000.0, "seed": 1, "kv_dtype": "bfloat16",
    "weights_digest": "0123456789abcdef" * 2, "layer_pattern": "ra",
}
# The fields only a checkpoint's config sets, changed from a checkpoint's base config.
CHECKPOINT_BASE = {"checkpoint": "/ckpt/a", "architecture": "LlamaForCausalLM",
                   "weights_digest": "ab" * 16}
CHECKPOINT_VALUES = {"checkpoint": "/ckpt/b", "architecture": "Qwen2ForCausalLM",
                     "rms_norm_eps": 1e-5, "attention_bias": True, "tie_embeddings": True}


def test_every_model_field_that_changes_kv_changes_the_fingerprint() -> None:
    from pd_cache.core.config import KV_NEUTRAL_FIELDS

    assert set(OTHER_VALUES) | set(CHECKPOINT_VALUES) == {f.name for f in
                                                         dataclasses.fields(ModelConfig)}
    checkpoint = PDCacheConfig(model=ModelConfig(**CHECKPOINT_BASE))
    for base, values in ((PDCacheConfig(), OTHER_VALUES), (checkpoint, CHECKPOINT_VALUES)):
        for name, value in values.items():
            other = dataclasses.replace(base, model=dataclasses.replace(base.model,
                                                                        **{name: value}))
            same = other.layout.fingerprint == base.layout.fingerprint
            assert same == (name in KV_NEUTRAL_FIELDS), name
    assert KV_NEUTRAL_FIELDS == {"max_context", "checkpoint"}


def test_checkpoint_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="model.architecture"):
        ModelConfig(architecture="LlamaForCausalLM")      # no checkpoint
    with pytest.raises(ValueError, match="model.architecture"):
        ModelConfig(**{**CHECKPOINT_BASE, "architecture": "GPT2LMHeadModel"})
    with pytest.raises(ValueError, match="model.weights_digest"):
        ModelConfig(**{**CHECKPOINT_BASE, "weights_digest": ""})
    with pytest.raises(ValueError, match="model.rms_norm_eps"):
        ModelConfig(**{**CHECKPOINT_BASE, "rms_norm_eps": 0.0})


def test_page_size_and_tp_rank_layout_change_the_fingerprint() -> None:
    base = PDCacheConfig()
    paged = dataclasses.replace(base, cache=dataclasses.replace(base.cache, page_size=8))
    assert paged.layout.fingerprint != base.layout.fingerprint
    ranks = {dataclasses.replace(base.layout, tp_size=2, tp_rank=r).fingerprint for r in (0, 1)}
    assert len(ranks | {base.layout.fingerprint}) == 3


def test_a_model_override_from_the_environment_changes_the_fingerprint() -> None:
    wider = PDCacheConfig.from_env({"PD_CACHE_MODEL_HIDDEN_SIZE": "128"})
    assert wider.model.hidden_size == 128
    assert wider.layout.fingerprint != PDCacheConfig.from_env({}).layout.fingerprint
    with pytest.raises(ValueError, match="layout"):
        wider.check_compatible(PDCacheConfig())


def test_unpinned_weights_digest_is_derived_from_the_config() -> None:
    base = PDCacheConfig()
    assert base.layout.weights_digest == PDCacheConfig().layout.weights_digest != ""
    pinned = dataclasses.replace(base.model, weights_digest="ab" * 16)
    assert PDCacheConfig(model=pinned).layout.weights_digest == "ab" * 16


@pytest.mark.parametrize("bad", ["xyz", "AB" * 16, "ab" * 15, 7])
def test_weights_digest_must_be_empty_or_an_xxh3_128_hex_digest(bad: object) -> None:
    with pytest.raises(ValueError, match="model.weights_digest"):
        ModelConfig(weights_digest=bad)  # type: ignore[arg-type]


FINGERPRINT_SCRIPT = """
from pd_cache.core.config import PDCacheConfig
print(PDCacheConfig.from_env({"PD_CACHE_MODEL_HIDDEN_SIZE": "128"}).layout.fingerprint)
"""


def test_equal_configs_give_equal_fingerprints_in_another_process() -> None:
    out = subprocess.run([sys.executable, "-c", FINGERPRINT_SCRIPT], check=True,
                         capture_output=True, text=True, env={**os.environ,
                                                              "PYTHONHASHSEED": "random"})
    here = PDCacheConfig.from_env({"PD_CACHE_MODEL_HIDDEN_SIZE": "128"}).layout.fingerprint
    assert out.stdout.strip() == here
