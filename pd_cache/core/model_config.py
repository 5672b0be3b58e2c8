"""``ModelConfig``: the shape and identity of a model (a built-in preset or a checkpoint),
and the digest rules that decide which of its fields a KV page's bytes depend on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import xxhash

from pd_cache.core.fields import check, check_positive, check_positive_int, one_of
from pd_cache.core.pretrained import ARCHITECTURES, model_fields

# Bytes per element of each ``kv_dtype``; its keys are the dtypes a page may hold.
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPES = tuple(KV_DTYPE_BYTES)
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


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference decoder-only transformer (see ``pd_cache.model.model``).

    ``weights_digest`` names the exact weights: the xxh3_128 hex digest of their bytes
    (``pd_cache.model.digest``). Empty means "the weights this config seeds", which
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
