"""Configuration: one frozen dataclass per component, combined in ``PDCacheConfig``.

Every invalid value raises ``ValueError`` at construction, naming the field. Environment
overrides are read in one place, :meth:`PDCacheConfig.from_env`, with the prefix
``PD_CACHE_``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import xxhash

from pd_cache.core.fields import (
    check,
    check_int_at_least,
    check_non_negative,
    check_positive,
    check_positive_int,
    one_of,
    read_text,
)
from pd_cache.core.hashing import DIGEST_SIZES
from pd_cache.core.pretrained import ARCHITECTURES, model_fields

KV_DTYPES = ("float32", "bfloat16", "float16")
WRITE_POLICIES = ("write_through", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
ENV_PREFIX = "PD_CACHE_"
# ModelConfig fields that change neither the weights nor how K and V are computed, so pages
# stay shareable across them: the rotary tables span max_context positions, but the angles of
# position p do not depend on how many positions the table holds. A checkpoint's directory
# is where its files are, not what they are (its config fields and weights digest say that).
KV_NEUTRAL_FIELDS = frozenset({"max_context", "checkpoint"})
# Fields that join a digest only when they differ from these defaults: a model without them
# (a plain preset) keeps the fingerprint, and so the L3 pages, it had before they existed.
# Hybrid models (layer_pattern, the state's shape) and checkpoints (their architecture).
LATE_FIELDS = {"layer_pattern": "", "state_layers": 0, "state_dim": 0, "architecture": "",
               "rms_norm_eps": 1e-6, "attention_bias": False, "tie_embeddings": False}
ATTENTION, RECURRENT = "a", "r"   # the letters of ModelConfig.layer_pattern

# The L3 backend registry: name -> "module:Class" (a class with ``from_config``), imported
# lazily by ``pd_cache.storage.backend_class``. Adding a backend is one module and one entry
# (or ``pd_cache.storage.register_backend``); ``StorageConfig.backend`` is checked here.
STORAGE_BACKENDS: dict[str, str] = {
    "memory": "pd_cache.storage.memory:MemoryBackend",
    "disk": "pd_cache.storage.disk:DiskBackend",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference decoder-only transformer (see ``pd_cache.worker.model``).

    ``weights_digest`` names the exact weights: the xxh3_128 hex digest of their bytes
    (``pd_cache.worker.digest``). Empty means "the weights this config seeds", which
    ``kv_digest`` identifies; a cluster pins the digest of the built weights at start.

    ``layer_pattern`` makes a hybrid model: one letter per layer, ``a`` (attention, whose
    K and V go into KV pages) or ``r`` (a gated linear recurrence whose fixed-size state,
    ``hidden_size`` floats, is what a cached prefix must also resume from). Empty: every
    layer attends (the plain presets).

    ``checkpoint`` is a local Hugging Face checkpoint directory (``from_pretrained``) whose
    ``architecture`` (``pd_cache.core.pretrained.ARCHITECTURES``), norm epsilon, q/k/v bias
    and tied embeddings the last four fields carry; empty for the built-in model.
    """

    name: str = "tiny"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_context: int = 1024
    rope_theta: float = 10000.0
    seed: int = 0
    kv_dtype: str = "float32"
    weights_digest: str = ""
    layer_pattern: str = ""
    checkpoint: str = ""
    architecture: str = ""
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        check(isinstance(self.name, str) and bool(self.name), "model.name", self.name,
               "a non-empty str")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_context"):
            check_positive_int(f"model.{name}", getattr(self, name))
        check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
               self.num_kv_heads, f"a divisor of num_heads={self.num_heads}")
        check(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "an even number")
        check(self.vocab_size <= 2**32, "model.vocab_size", self.vocab_size, "<= 2**32")
        one_of("model.kv_dtype", self.kv_dtype, KV_DTYPES)
        check(self.weights_digest == "" or _is_digest(self.weights_digest),
              "model.weights_digest", self.weights_digest, "'' or 32 lowercase hex digits")
        pattern = self.layer_pattern
        check(isinstance(pattern, str) and (pattern == "" or (
            len(pattern) == self.num_layers and set(pattern) <= {ATTENTION, RECURRENT}
            and ATTENTION in pattern)), "model.layer_pattern", pattern,
            f"'' or {self.num_layers} letters of 'a' (attention, at least one) and 'r' "
            f"(recurrent)")
        check(self.architecture in (ARCHITECTURES if self.checkpoint else ("",)),
              "model.architecture", self.architecture,
              f"one of {list(ARCHITECTURES)} with a checkpoint, else ''")
        check_positive("model.rms_norm_eps", self.rms_norm_eps)
        check(not self.checkpoint or bool(self.weights_digest), "model.weights_digest",
              self.weights_digest, "the checkpoint's digest (ModelConfig.from_pretrained)")
        check(not (self.checkpoint and pattern), "model.layer_pattern", pattern,
              "'' for a checkpoint (hybrid checkpoints are not supported)")

    @property
    def kinds(self) -> str:
        """One letter per layer: ``a`` attention, ``r`` recurrent."""
        return self.layer_pattern or ATTENTION * self.num_layers

    @property
    def attention_layers(self) -> int:
        """Layers whose K and V a KV page holds."""
        return self.kinds.count(ATTENTION)

    @property
    def recurrent_layers(self) -> int:
        """Layers whose state (``hidden_size`` floats each) a cached prefix resumes from."""
        return self.kinds.count(RECURRENT)

    @property
    def kv_digest(self) -> str:
        """Stable digest of every field that changes the weights or how K and V are computed
        (all but ``KV_NEUTRAL_FIELDS``; the layout carries ``weights_digest`` itself)."""
        skip = KV_NEUTRAL_FIELDS | {"weights_digest"}
        return _digest(b"pd-cache/model/v1", _set_fields(self, skip))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset: ``tiny`` (fast tests) or ``small`` (benchmarks), and their hybrid
        forms ``tiny-hybrid`` and ``small-hybrid`` (attention and recurrent layers)."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"model.name: unknown preset {name!r}; expected one of "
                             f"{sorted(MODEL_PRESETS)}")
        return dataclasses.replace(MODEL_PRESETS[name], **overrides)

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> ModelConfig:
        """The config of the local Hugging Face checkpoint at ``path`` (``config.json`` and
        ``*.safetensors``), its weights digest pinned; ``ValueError`` naming a missing file
        or an unsupported architecture. ``overrides`` (such as ``kv_dtype``) replace fields.
        """
        return cls(**{**model_fields(path), **overrides})


MODEL_PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(name="small", vocab_size=4096, hidden_size=256, num_layers=4,
                         num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=768,
                         max_context=4096),
    "tiny-hybrid": ModelConfig(name="tiny-hybrid", num_layers=4, layer_pattern="rara"),
    "small-hybrid": ModelConfig(name="small-hybrid", vocab_size=4096, hidden_size=256,
                                num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                                intermediate_size=768, max_context=4096, layer_pattern="rara"),
}


@dataclass(frozen=True)
class KVLayout:
    """Layout of one KV page; its fingerprint partitions L3 between models and layouts.

    A page is ``[2, num_layers, page_size, num_kv_heads, head_dim]`` (K and V of the
    attention layers). A hybrid model also keeps, at checkpoint pages, the recurrent state
    after the page: ``[state_layers, state_dim]`` float32 (``state_shape``; none when
    ``state_layers`` is 0). ``model_id`` and ``weights_digest`` say which model computed
    it (see ``PDCacheConfig.layout``); ``weights_digest`` is empty only in hand-made layouts.
    """

    model_id: str
    kv_dtype: str
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    weights_digest: str = ""
    state_layers: int = 0
    state_dim: int = 0

    def __post_init__(self) -> None:
        check(isinstance(self.weights_digest, str), "layout.weights_digest",
              self.weights_digest, "a str")
        for name in ("state_layers", "state_dim"):
            check_int_at_least(f"layout.{name}", getattr(self, name), 0)
        check((self.state_layers == 0) == (self.state_dim == 0), "layout.state_dim",
              self.state_dim, f"0 exactly when state_layers is 0 (it is {self.state_layers})")
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "tp_size"):
            check_positive_int(f"layout.{name}", getattr(self, name))
        check(isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size,
               "layout.tp_rank", self.tp_rank, f"an int in [0, {self.tp_size})")
        one_of("layout.kv_dtype", self.kv_dtype, KV_DTYPES)

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def state_shape(self) -> tuple[int, int]:
        """Shape of one recurrent state (after a page): ``[state_layers, state_dim]``."""
        return (self.state_layers, self.state_dim)

    @property
    def has_state(self) -> bool:
        """Whether a prefix resumes from a recurrent state as well as from KV (hybrid)."""
        return self.state_layers > 0

    @property
    def fingerprint(self) -> str:
        """Stable hex digest of every field (never Python's salted ``hash()``)."""
        return _digest(b"pd-cache/layout/v2", _set_fields(self, frozenset()))


@dataclass(frozen=True)
class CacheConfig:
    """The worker-local tiers: L1 device pool, L2 host pool and their radix tree.

    ``state_every_pages``: a hybrid model keeps its recurrent state at every page whose
    count is a multiple of this, and at the last full page of each write (the pages a
    cached prefix may resume from; see ``pd_cache.kv.state``).
    """

    page_size: int = 16
    hash_algo: str = "xxh3_128"
    device_pages: int = 256
    host_pages: int = 1024
    write_policy: str = "write_through"
    state_every_pages: int = 4

    def __post_init__(self) -> None:
        check_positive_int("cache.page_size", self.page_size)
        check_positive_int("cache.state_every_pages", self.state_every_pages)
        one_of("cache.hash_algo", self.hash_algo, tuple(DIGEST_SIZES))
        check_non_negative("cache.device_pages", self.device_pages)
        check_non_negative("cache.host_pages", self.host_pages)
        one_of("cache.write_policy", self.write_policy, WRITE_POLICIES)


@dataclass(frozen=True)
class StorageConfig:
    """The L3 storage tier and the controller that prefetches from it."""

    enabled: bool = True
    backend: str = "memory"
    capacity_bytes: int = 1 << 30
    disk_path: str | None = None
    num_shards: int = 1
    batch_pages: int = 128
    prefetch_policy: str = "best_effort"
    prefetch_timeout_base_s: float = 0.05
    prefetch_timeout_per_1k_tokens_s: float = 0.05
    prefetch_timeout_max_s: float = 2.0
    prefix_keys: bool = True
    metrics_interval_s: float = 5.0

    def __post_init__(self) -> None:
        one_of("storage.backend", self.backend, tuple(sorted(STORAGE_BACKENDS)))
        check_positive_int("storage.capacity_bytes", self.capacity_bytes)
        check(self.backend != "disk" or bool(self.disk_path), "storage.disk_path",
               self.disk_path, "a directory when backend='disk'")
        check_positive_int("storage.num_shards", self.num_shards)
        check_positive_int("storage.batch_pages", self.batch_pages)
        one_of("storage.prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s",
                     "prefetch_timeout_max_s"):
            check_non_negative(f"storage.{name}", getattr(self, name))
        check_positive("storage.metrics_interval_s", self.metrics_interval_s)

    @property
    def shard_capacity_bytes(self) -> int:
        """Each tier actor's share: ``capacity_bytes`` is split evenly over the shards."""
        return max(1, self.capacity_bytes // self.num_shards)


@dataclass(frozen=True)
class PDCacheConfig:
    """Everything a worker needs; prefill and decode must share model and page size."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check(self.model.max_context >= self.cache.page_size, "cache.page_size",
               self.cache.page_size, f"<= model.max_context={self.model.max_context}")

    @property
    def layout(self) -> KVLayout:
        """The KV layout every worker and storage shard of this config uses.

        ``model_id`` is the preset name and ``model.kv_digest``. ``weights_digest`` is
        ``model.weights_digest`` if pinned, else derived from ``kv_digest`` (the weights the
        config seeds), so a caller with no model gets the layout a worker of the same config
        uses; a worker checks pinned weights against its own (``pd_cache.worker.digest``).
        """
        m, kv = self.model, self.model.kv_digest
        state_layers = m.recurrent_layers
        return KVLayout(model_id=f"{m.name}/{kv}", kv_dtype=m.kv_dtype,
                        num_layers=m.attention_layers, page_size=self.cache.page_size,
                        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                        weights_digest=m.weights_digest or f"config:{kv}",
                        state_layers=state_layers,
                        state_dim=m.hidden_size if state_layers else 0)

    def check_compatible(self, other: PDCacheConfig) -> None:
        """Cross-role rule: two workers exchanging KV must agree on its layout."""
        if self.layout != other.layout or self.cache.hash_algo != other.cache.hash_algo:
            raise ValueError(f"layout: workers disagree: {self.layout} / {other.layout}, "
                             f"algo {self.cache.hash_algo} / {other.cache.hash_algo}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **base: Any) -> PDCacheConfig:
        """Build from defaults, ``base`` sections, then ``PD_CACHE_<SECTION>_<FIELD>``.

        For example ``PD_CACHE_MODEL_NAME=small`` or ``PD_CACHE_STORAGE_BACKEND=disk``.
        """
        env = os.environ if env is None else env
        sections: dict[str, Any] = {}
        for section, klass in (("model", ModelConfig), ("cache", CacheConfig),
                               ("storage", StorageConfig)):
            current = base.get(section) or klass()
            preset = env.get(f"{ENV_PREFIX}MODEL_NAME") if section == "model" else None
            if preset:
                current = ModelConfig.preset(preset)
            sections[section] = dataclasses.replace(current,
                                                    **_env_fields(env, section, klass))
        return cls(**sections)


def _digest(tag: bytes, values: dict[str, Any]) -> str:
    """xxh3_128 hex digest of ``name=repr(value)`` pairs, in the order given."""
    text = "|".join(f"{name}={value!r}" for name, value in values.items())
    return xxhash.xxh3_128_hexdigest(tag + b"\x00" + text.encode("utf-8"))


def _set_fields(obj: Any, skip: frozenset[str]) -> dict[str, Any]:
    """``obj``'s fields but ``skip``, and the late ones only when set (``LATE_FIELDS``)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if f.name not in skip and getattr(obj, f.name) != LATE_FIELDS.get(f.name, ...)}


def _is_digest(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 32 and all(c in "0123456789abcdef"
                                                             for c in text)


def _env_fields(env: Any, section: str, klass: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(klass):
        key = f"{ENV_PREFIX}{section.upper()}_{f.name.upper()}"
        if key in env and not (section == "model" and f.name == "name"):
            out[f.name] = read_text(key, env[key], f.type)
    return out
