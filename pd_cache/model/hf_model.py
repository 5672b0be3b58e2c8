"""A local Hugging Face checkpoint (Llama, Qwen2) as a model the engine runs.

``HFModel`` is a ``Model``: the same forward over new tokens after a cached prefix, the same
batched ``decode_step``, the same checks and the same KV layout ``[2, L, T, Hkv, D]``
(paged as ``[n, 2, L, page_size, Hkv, D]``); only its blocks and weights differ. The
weights are read from the checkpoint's safetensors files (``safetensors``, the ``hf``
extra) into float32 tensors; what the architecture is made of:

    embed_tokens -> L x [ RMSNorm -> attention (GQA, RoPE with rope_theta; q/k/v bias
    for Qwen2) -> + ; RMSNorm -> SwiGLU MLP -> + ] -> RMSNorm -> lm_head (or embed_tokens
    when tied)

Nothing is downloaded, and a checkpoint whose files are not those its config pinned
(``ModelConfig.weights_digest``) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pd_cache.core.config import ModelConfig
from pd_cache.core.pretrained import checkpoint_digest, weight_files
from pd_cache.kv.pages import kv_torch_dtype
from pd_cache.model.layers import (
    PrefixMask,
    RMSNorm,
    Rotary,
    attend_prefix,
    attend_step,
    gated,
)
from pd_cache.model.model import Model

LLAMA = "LlamaForCausalLM"


class Tensors:
    """The checkpoint's tensors, each taken once with its shape checked; ``ValueError``
    naming the tensor that is missing, misshapen or left over."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.where = cfg.checkpoint
        self.left = load_tensors(cfg)

    def take(self, name: str, *shape: int) -> nn.Parameter:
        if name not in self.left:
            raise ValueError(f"model: checkpoint {self.where!r} has no tensor {name!r}")
        tensor = self.left.pop(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"model: tensor {name!r} of {self.where!r} has shape "
                             f"{list(tensor.shape)}, expected {list(shape)}")
        return nn.Parameter(tensor, requires_grad=False)

    def linear(self, name: str, rows: int, cols: int, bias: bool) -> Linear:
        return Linear(self.take(f"{name}.weight", rows, cols),
                      self.take(f"{name}.bias", rows) if bias else None)

    def check_all_taken(self) -> None:
        # NOTE: older checkpoints store RoPE frequencies; they are recomputed from rope_theta.
        extra = sorted(n for n in self.left if not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise ValueError(f"model: checkpoint {self.where!r} has tensors this architecture "
                             f"does not use, such as {extra[0]!r}")


def load_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as float32; ``ValueError`` if its files are not the
    ones ``cfg`` pinned (``weights_digest``)."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ValueError("model: serving a checkpoint needs the hf extra "
                         "(pip install 'pd-cache[hf]')") from None
    found = checkpoint_digest(cfg.checkpoint)
    if found != cfg.weights_digest:
        raise ValueError(f"model.weights_digest: {cfg.weights_digest} is not the digest "
                         f"{found} of the weights in {cfg.checkpoint!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(cfg.checkpoint):
        tensors.update((k, v.float()) for k, v in load_file(file).items())
    return tensors


class Linear(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class HFAttention(nn.Module):
    """Grouped-query attention with RoPE and optional biases; the KV paths of
    ``pd_cache.model.model.Attention`` (prefix + new tokens, one token per sequence)."""

    def __init__(self, cfg: ModelConfig, w: Tensors, prefix: str, rotary: Rotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                             cfg.head_dim)
        self.kv_dtype, self.rotary = kv_torch_dtype(cfg.kv_dtype), rotary
        h, q, kv, bias = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                          cfg.num_kv_heads * cfg.head_dim, cfg.attention_bias)
        self.q_proj = w.linear(f"{prefix}.q_proj", q, h, bias)
        self.k_proj = w.linear(f"{prefix}.k_proj", kv, h, bias)
        self.v_proj = w.linear(f"{prefix}.v_proj", kv, h, bias)
        # NOTE: Qwen2 biases q/k/v only; Llama's attention_bias biases o_proj too.
        self.o_proj = w.linear(f"{prefix}.o_proj", h, q, bias and cfg.architecture == LLAMA)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        return (self.q_proj(x).view(n, self.num_heads, self.head_dim),
                self.k_proj(x).view(n, self.num_kv_heads, self.head_dim),
                self.v_proj(x).view(n, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, past: torch.Tensor,
                how: PrefixMask) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` after ``past`` ``[2, P, Hkv, D]`` -> output, new KV."""
        start = past.shape[1]
        q, k, v = self._qkv(x)
        out, new = attend_prefix(self.rotary(q, start), self.rotary(k, start), v, past,
                                 self.kv_dtype, how)
        return self.o_proj(out), new

    def step(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
             positions: list[int], pos: torch.Tensor) -> torch.Tensor:
        """One token per sequence (see ``Attention.step``): writes each new KV in place."""
        q, k, v = self._qkv(x)
        q, k = self.rotary.at(q, pos), self.rotary.at(k, pos)
        new = torch.stack([k, v], dim=1).to(self.kv_dtype)   # [B, 2, Hkv, D]
        return self.o_proj(attend_step(q, new, bufs, layer, positions))


class HFBlock(nn.Module):
    """One decoder layer: pre-norm attention and a pre-norm SwiGLU MLP, both residual."""

    def __init__(self, cfg: ModelConfig, w: Tensors, i: int, rotary: Rotary) -> None:
        super().__init__()
        p, h, m = f"model.layers.{i}", cfg.hidden_size, cfg.intermediate_size
        self.input_layernorm = _norm(w.take(f"{p}.input_layernorm.weight", h), cfg)
        self.self_attn = HFAttention(cfg, w, f"{p}.self_attn", rotary)
        self.post_attention_layernorm = _norm(w.take(f"{p}.post_attention_layernorm.weight", h),
                                              cfg)
        self.gate_proj = w.linear(f"{p}.mlp.gate_proj", m, h, False)
        self.up_proj = w.linear(f"{p}.mlp.up_proj", m, h, False)
        self.down_proj = w.linear(f"{p}.mlp.down_proj", h, m, False)

    def forward(self, x: torch.Tensor, past: torch.Tensor,
                how: PrefixMask) -> tuple[torch.Tensor, torch.Tensor]:
        attn, new = self.self_attn(self.input_layernorm(x), past, how)
        return self._mlp(x + attn), new

    def step(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
             positions: list[int], pos: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.self_attn.step(self.input_layernorm(x), bufs, layer,
                                                 positions, pos))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(gated(h, self.gate_proj.weight, self.up_proj.weight,
                                        self.gate_proj.bias, self.up_proj.bias))


def _norm(weight: nn.Parameter, cfg: ModelConfig) -> RMSNorm:
    with torch.device("meta"):
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight = weight
    return norm


class HFModel(Model):
    """A checkpoint's decoder behind ``Model``'s interface (forward over a cached prefix,
    ``decode_step``, checks); ``ValueError`` naming a missing file or tensor."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        if not cfg.checkpoint:
            raise ValueError(f"model.checkpoint: model {cfg.name!r} has no checkpoint")
        # NOTE: nn.Module's init, not Model's: Model's would draw seeded random weights.
        nn.Module.__init__(self)
        self.cfg, self.kv_dtype = cfg, kv_torch_dtype(cfg.kv_dtype)
        w = Tensors(cfg)
        rotary = Rotary(cfg.head_dim, cfg.max_context, cfg.rope_theta)
        self.embed = w.take("model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(HFBlock(cfg, w, i, rotary) for i in range(cfg.num_layers))
        self.norm = _norm(w.take("model.norm.weight", cfg.hidden_size), cfg)
        if cfg.tie_embeddings:
            w.left.pop("lm_head.weight", None)   # a tied copy, if the checkpoint kept one
            self.lm_head = self.embed
        else:
            self.lm_head = w.take("lm_head.weight", cfg.vocab_size, cfg.hidden_size)
        w.check_all_taken()
        self.to(device).eval()


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> Model:
    """The model ``cfg`` describes: its checkpoint's, or the built-in seeded one."""
    return HFModel(cfg, device) if cfg.checkpoint else Model(cfg, device)


__all__ = ["HFModel", "build_model", "load_tensors"]
