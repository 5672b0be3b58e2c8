"""The reference model: a small decoder-only transformer whose KV moves in pages.

RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP. Weights are drawn from
``torch.Generator().manual_seed(cfg.seed)``, so every process builds the identical model and
nothing is downloaded. Compute is float32; K and V are rounded to ``cfg.kv_dtype`` as soon as
they are produced, in every path, so attention over a prefix read back from a page equals
attention over the same prefix computed in the same forward.

KV goes in and out contiguous, ``[2, L, T, Hkv, D]``; ``pd_cache.kv.pages`` (re-exported
here) converts to and from pages ``[n, 2, L, page_size, Hkv, D]`` and checks them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pd_cache.core.config import ModelConfig
from pd_cache.core.request import Req, SamplingParams
from pd_cache.kv.pages import (
    KV_TORCH_DTYPES,
    check_pages,
    check_tensor,
    kv_to_pages,
    kv_torch_dtype,
    num_pages_for,
    pages_to_kv,
)


class ForwardOutput(NamedTuple):
    """``logits``: float32 ``[T, V]`` (``[1, V]`` for the last token only);
    ``kv``: the new tokens' KV, ``[2, L, T, Hkv, D]`` in the KV dtype."""

    logits: torch.Tensor
    kv: torch.Tensor


class Generation(NamedTuple):
    """What ``reference_generate`` produced: the tokens and the logits each was drawn from."""

    output_ids: list[int]
    logits: list[torch.Tensor]


def _weight(g: torch.Generator, rows: int, cols: int) -> nn.Parameter:
    w = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
    return nn.Parameter(w, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form), tables precomputed for the context."""

    def __init__(self, head_dim: int, max_context: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_context, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, D]`` for positions ``start .. start + T - 1``."""
        end = start + x.shape[0]
        cos, sin = self.cos[start:end, None, :], self.sin[start:end, None, :]
        return _rotate(x, cos, sin)

    def at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, H, D]``, row ``b`` for position ``positions[b]``."""
        return _rotate(x, self.cos[positions][:, None, :], self.sin[positions][:, None, :])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, g: torch.Generator, rotary: Rotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                             cfg.head_dim)
        self.kv_dtype = kv_torch_dtype(cfg.kv_dtype)
        self.rotary = rotary
        self.wq = _weight(g, cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.wk = _weight(g, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
        self.wv = _weight(g, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
        self.wo = _weight(g, cfg.hidden_size, cfg.num_heads * cfg.head_dim)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` after ``past`` ``[2, P, Hkv, D]`` -> output, new KV."""
        t, start = x.shape[0], past.shape[1]
        q = self.rotary(F.linear(x, self.wq).view(t, self.num_heads, self.head_dim), start)
        k = self.rotary(F.linear(x, self.wk).view(t, self.num_kv_heads, self.head_dim), start)
        v = F.linear(x, self.wv).view(t, self.num_kv_heads, self.head_dim)
        # NOTE: round to the storage dtype before attending, so the cached and uncached
        # paths attend over exactly the same values.
        new = torch.stack([k, v]).to(self.kv_dtype)
        kv = torch.cat([past.float(), new.float()], dim=1)
        # NOTE: 4-D inputs [1, H, T, D]: on CPU only those take the fused kernel (3-D ones
        # fall back to the math path, ~6x slower).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None],
            attn_mask=_causal_mask(t, start), enable_gqa=True)
        return F.linear(out[0].transpose(0, 1).reshape(t, -1), self.wo), new

    def step(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
             positions: list[int], pos: torch.Tensor) -> torch.Tensor:
        """One new token per sequence: ``x`` ``[B, hidden]``; row ``b`` is at position
        ``positions[b]`` of ``bufs[b]`` ``[2, L, >P, Hkv, D]``, whose KV it writes there and
        then attends over (keys ``0 .. positions[b]``)."""
        b, g = x.shape[0], self.num_heads // self.num_kv_heads
        q = self.rotary.at(F.linear(x, self.wq).view(b, self.num_heads, self.head_dim), pos)
        k = self.rotary.at(F.linear(x, self.wk).view(b, self.num_kv_heads, self.head_dim), pos)
        v = F.linear(x, self.wv).view(b, self.num_kv_heads, self.head_dim)
        new = torch.stack([k, v], dim=1).to(self.kv_dtype)   # [B, 2, Hkv, D]
        outs = []
        for i, (buf, p) in enumerate(zip(bufs, positions, strict=True)):
            buf[:, layer, p] = new[i]
            kv = buf[:, layer, :p + 1].float().transpose(1, 2)   # [2, Hkv, P + 1, D]
            # NOTE: one query token: the g query heads of a KV group are folded into the
            # query rows of that group (``[1, Hkv, g, D]``), so no mask and no GQA expansion.
            outs.append(F.scaled_dot_product_attention(
                q[i].view(1, self.num_kv_heads, g, self.head_dim), kv[0:1], kv[1:2]))
        out = torch.cat(outs).reshape(b, -1)
        return F.linear(out, self.wo)


def _causal_mask(t: int, start: int) -> torch.Tensor | None:
    """Query i (position ``start + i``) sees keys ``0 .. start + i``; ``None`` = sees all."""
    if t == 1:
        return None
    keys = torch.arange(start + t)
    return keys[None, :] <= (torch.arange(t) + start)[:, None]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, g: torch.Generator, rotary: Rotary) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg, g, rotary)
        self.mlp_norm = RMSNorm(cfg.hidden_size)
        self.w_gate = _weight(g, cfg.intermediate_size, cfg.hidden_size)
        self.w_up = _weight(g, cfg.intermediate_size, cfg.hidden_size)
        self.w_down = _weight(g, cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn, new = self.attn(self.attn_norm(x), past)
        x = x + attn
        return self._mlp(x), new

    def step(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
             positions: list[int], pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.step(self.attn_norm(x), bufs, layer, positions, pos)
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp_norm(x)
        return x + F.linear(F.silu(F.linear(h, self.w_gate)) * F.linear(h, self.w_up),
                            self.w_down)


class Model(nn.Module):
    """The reference transformer; ``forward`` extends a computed prefix by new tokens."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.kv_dtype = kv_torch_dtype(cfg.kv_dtype)
        g = torch.Generator().manual_seed(cfg.seed)
        rotary = Rotary(cfg.head_dim, cfg.max_context, cfg.rope_theta)
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g),
                                  requires_grad=False)
        self.blocks = nn.ModuleList(Block(cfg, g, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = _weight(g, cfg.vocab_size, cfg.hidden_size)
        self.to(device).eval()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.no_grad()
    def forward(self, token_ids: Any, past_kv: torch.Tensor | None = None, *,
                all_logits: bool = False) -> ForwardOutput:
        """Run ``token_ids`` after the prefix whose KV is ``past_kv`` ``[2, L, P, Hkv, D]``.

        Raises ``ValueError`` for a token id outside the vocabulary, a ``past_kv`` of the
        wrong shape or dtype, or ``P + T`` beyond the model's context.
        """
        ids = self._check_ids(token_ids)
        past = self._check_past(past_kv)
        self._check_context(past.shape[2], len(ids))
        x = self.embed[ids]
        new_kv = []
        for layer, block in enumerate(self.blocks):
            x, new = block(x, past[:, layer])
            new_kv.append(new)
        x = x if all_logits else x[-1:]
        return ForwardOutput(F.linear(self.norm(x), self.lm_head), torch.stack(new_kv, dim=1))

    @torch.no_grad()
    def decode_step(self, token_ids: Sequence[int], bufs: Sequence[torch.Tensor],
                    positions: Sequence[int]) -> torch.Tensor:
        """One token for each of ``B`` sequences in one forward; returns logits ``[B, V]``.

        Sequence ``b`` has the KV of its first ``positions[b]`` tokens in ``bufs[b]``
        ``[2, L, > positions[b], Hkv, D]`` (its own buffer, any length); its new token's KV
        is written in place at ``positions[b]``. Linear layers run batched, attention per
        sequence (each over its own length): the decode half of continuous batching.
        Raises ``ValueError`` for a token id outside the vocabulary or a buffer of the
        wrong shape, dtype or length.
        """
        ids = self._check_ids(token_ids)
        positions = [int(p) for p in positions]
        if not len(ids) == len(bufs) == len(positions):
            raise ValueError(f"decode_step: {len(ids)} tokens, {len(bufs)} buffers and "
                             f"{len(positions)} positions differ in number")
        for i, (buf, p) in enumerate(zip(bufs, positions)):
            check_kv(buf, self.cfg, field=f"bufs[{i}]")
            if not 0 <= p < min(buf.shape[2], self.cfg.max_context):
                raise ValueError(f"positions[{i}]: {p} is outside buffer of {buf.shape[2]} "
                                 f"tokens (model context {self.cfg.max_context})")
        pos = torch.tensor(positions, device=self.device)
        x = self.embed[ids]
        for layer, block in enumerate(self.blocks):
            x = block.step(x, bufs, layer, positions, pos)
        return F.linear(self.norm(x), self.lm_head)

    def _check_ids(self, token_ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids: expected a non-empty 1-D sequence, got shape "
                             f"{tuple(ids.shape)}")
        bad = (ids < 0) | (ids >= self.cfg.vocab_size)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"token_ids[{i}]: token id {int(ids[i])} is outside the "
                             f"vocabulary [0, {self.cfg.vocab_size})")
        return ids

    def _check_past(self, past_kv: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        if past_kv is None:
            return torch.empty(2, cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim,
                               dtype=self.kv_dtype, device=self.device)
        check_kv(past_kv, cfg, field="past_kv")
        return past_kv.to(self.device)

    def _check_context(self, num_past: int, num_new: int) -> None:
        if num_past + num_new > self.cfg.max_context:
            raise ValueError(f"token_ids: {num_past} cached + {num_new} new tokens exceed the "
                             f"model context {self.cfg.max_context}")


def check_kv(kv: Any, cfg: ModelConfig, *, field: str = "kv") -> None:
    """A contiguous KV tensor ``[2, L, T, Hkv, D]`` of the model's KV dtype, or ValueError."""
    check_tensor(kv, field, kv_torch_dtype(cfg.kv_dtype))
    want = (2, cfg.num_layers, None, cfg.num_kv_heads, cfg.head_dim)
    if kv.ndim != 5 or any(w is not None and w != s for w, s in zip(want, kv.shape, strict=True)):
        raise ValueError(f"{field}: expected shape [2, {cfg.num_layers}, T, "
                         f"{cfg.num_kv_heads}, {cfg.head_dim}], got {list(kv.shape)}")


def sample(logits: torch.Tensor, sampling: SamplingParams, step: int) -> int:
    """Next token from ``logits`` ``[V]``: argmax when greedy, else a seeded draw.

    The draw's generator is seeded from ``(sampling.seed, step)`` alone, so prefill (step 0)
    and decode (later steps) draw the same tokens in different processes.
    """
    if sampling.greedy:
        return int(torch.argmax(logits))
    g = torch.Generator().manual_seed((sampling.seed * 1_000_003 + step) % 2**63)
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=g))


def reference_generate(model: Model, req: Req) -> Generation:
    """Generate with no cache at all: every step reruns the whole sequence from scratch.

    This is the ground truth every cached path is compared to.
    """
    req.check_model(vocab_size=model.cfg.vocab_size, max_context=model.cfg.max_context)
    ids: list[int] = list(req.input_ids)
    out, all_logits = [], []
    for step in range(req.max_new_tokens):
        logits = model(ids).logits[-1]
        token = sample(logits, req.sampling, step)
        out.append(token)
        all_logits.append(logits)
        ids.append(token)
    return Generation(out, all_logits)


__all__ = [
    "ForwardOutput", "Generation", "KV_TORCH_DTYPES", "Model", "check_kv",
    "check_pages", "kv_to_pages", "kv_torch_dtype", "num_pages_for", "pages_to_kv",
    "reference_generate", "sample",
]
