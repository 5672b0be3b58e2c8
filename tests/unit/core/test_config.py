"""Config: frozen, validated at construction, environment read in one place."""

from __future__ import annotations

import dataclasses

import pytest

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig


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
    (lambda: StorageConfig(prefetch_timeout_max_s=-1), "prefetch_timeout_max_s"),
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
