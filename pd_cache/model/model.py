"""The reference model: a small decoder-only transformer whose KV moves in pages.

RMSNorm, rotary positions, grouped-query attention and a SwiGLU MLP (``layers``). Weights
are drawn from ``torch.Generator().manual_seed(cfg.seed)``, so every process builds the
identical model and nothing is downloaded. Compute is float32; K and V are rounded to
``cfg.kv_dtype`` as soon as they are produced, in every path, so attention over a prefix
read back from a page equals attention over the same prefix computed in the same forward.

A hybrid model (``cfg.layer_pattern``) has recurrent layers between the attention layers.
Their state (``[R, hidden]`` float32, one row per recurrent layer) is what a resumed prefix
needs besides its KV: ``forward`` takes the state after the prefix and returns the state
after the new tokens, and after any of them asked for (``state_at``: page boundaries).

KV goes in and out contiguous, ``[2, L, T, Hkv, D]`` (L: the attention layers);
``pd_cache.kv.pages`` converts to and from pages
``[n, 2, L, page_size, Hkv, D]`` and checks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pd_cache.core.config import ATTENTION, ModelConfig
from pd_cache.core.request import Req, SamplingParams
from pd_cache.kv.pages import check_tensor, kv_torch_dtype
from pd_cache.model.layers import (
    Attention,
    PrefixMask,
    Recurrence,
    RMSNorm,
    Rotary,
    gated,
    prefix_mask,
    weight,
)


class ForwardOutput(NamedTuple):
    """``logits``: float32 ``[T, V]`` (``[1, V]`` for the last token only);
    ``kv``: the new tokens' KV, ``[2, L, T, Hkv, D]`` in the KV dtype; for a hybrid model
    ``state``: the recurrent state after the last token ``[R, hidden]``, and ``states``:
    the state after each ``state_at`` count of new tokens ``[len(state_at), R, hidden]``
    (both ``None`` for a plain model)."""

    logits: torch.Tensor
    kv: torch.Tensor
    state: torch.Tensor | None = None
    states: torch.Tensor | None = None


class Generation(NamedTuple):
    """What ``reference_generate`` produced: the tokens and the logits each was drawn from."""

    output_ids: list[int]
    logits: list[torch.Tensor]


class _MLPBlock(nn.Module):
    """A pre-norm layer: a token mixer (attention or recurrence), then a SwiGLU MLP."""

    def _add_mlp(self, cfg: ModelConfig, g: torch.Generator) -> None:
        self.mlp_norm = RMSNorm(cfg.hidden_size)
        self.w_gate = weight(g, cfg.intermediate_size, cfg.hidden_size)
        self.w_up = weight(g, cfg.intermediate_size, cfg.hidden_size)
        self.w_down = weight(g, cfg.hidden_size, cfg.intermediate_size)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(gated(self.mlp_norm(x), self.w_gate, self.w_up), self.w_down)


class Block(_MLPBlock):
    def __init__(self, cfg: ModelConfig, g: torch.Generator, rotary: Rotary) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg, g, rotary)
        self._add_mlp(cfg, g)

    def forward(self, x: torch.Tensor, past: torch.Tensor,
                how: PrefixMask) -> tuple[torch.Tensor, torch.Tensor]:
        attn, new = self.attn(self.attn_norm(x), past, how)
        x = x + attn
        return self._mlp(x), new

    def step(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
             positions: list[int], pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.step(self.attn_norm(x), bufs, layer, positions, pos)
        return self._mlp(x)


class RecurrentBlock(_MLPBlock):
    def __init__(self, cfg: ModelConfig, g: torch.Generator) -> None:
        super().__init__()
        self.rec_norm = RMSNorm(cfg.hidden_size)
        self.rec = Recurrence(cfg, g)
        self._add_mlp(cfg, g)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> output, and the state after each token ``[T, hidden]``."""
        out, states = self.rec(self.rec_norm(x), state)
        return self._mlp(x + out), states

    def step(self, x: torch.Tensor, states: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._mlp(x + self.rec.step(self.rec_norm(x), states))


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
        self.blocks = nn.ModuleList(Block(cfg, g, rotary) if kind == ATTENTION
                                    else RecurrentBlock(cfg, g) for kind in cfg.kinds)
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = weight(g, cfg.vocab_size, cfg.hidden_size)
        self.to(device).eval()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.no_grad()
    def forward(self, token_ids: Any, past_kv: torch.Tensor | None = None, *,
                all_logits: bool = False, state: torch.Tensor | None = None,
                state_at: Sequence[int] = ()) -> ForwardOutput:
        """Run ``token_ids`` after the prefix whose KV is ``past_kv`` ``[2, L, P, Hkv, D]``
        and, for a hybrid model, whose recurrent state is ``state`` ``[R, hidden]`` (``None``:
        zeros, the state before any token). ``state_at``: counts of new tokens (1..T) after
        which the state is also returned (``ForwardOutput.states``).

        Raises ``ValueError`` for a token id outside the vocabulary, a ``past_kv`` or
        ``state`` of the wrong shape or dtype, a ``state_at`` outside 1..T, or ``P + T``
        beyond the model's context.
        """
        ids = self._check_ids(token_ids)
        past = self._check_past(past_kv)
        self._check_context(past.shape[2], len(ids))
        h0 = self._check_state(state)
        at = _check_state_at(state_at, len(ids))
        x = self.embed[ids]
        how = prefix_mask(len(ids), past.shape[2], self.device)
        new_kv, finals, kept = [], [], []
        for block, kind in zip(self.blocks, self.cfg.kinds, strict=True):
            if kind == ATTENTION:
                x, new = block(x, past[:, len(new_kv)], how)
                new_kv.append(new)
            else:
                x, states = block(x, h0[len(finals)])
                finals.append(states[-1])
                kept.append(states[at])
        x = x if all_logits else x[-1:]
        logits = F.linear(self.norm(x), self.lm_head)
        if not finals:
            return ForwardOutput(logits, torch.stack(new_kv, dim=1))
        return ForwardOutput(logits, torch.stack(new_kv, dim=1), torch.stack(finals),
                             torch.stack(kept, dim=1))

    @torch.no_grad()
    def decode_step(self, token_ids: Sequence[int], bufs: Sequence[torch.Tensor],
                    positions: Sequence[int],
                    states: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """One token for each of ``B`` sequences in one forward; returns logits ``[B, V]``.

        Sequence ``b`` has the KV of its first ``positions[b]`` tokens in ``bufs[b]``
        ``[2, L, > positions[b], Hkv, D]`` (its own buffer, any length); its new token's KV
        is written in place at ``positions[b]``. A hybrid model also takes each sequence's
        recurrent state after those tokens, ``states[b]`` ``[R, hidden]``, and advances it
        in place. Linear layers run batched, attention per sequence (each over its own
        length): the decode half of continuous batching.
        Raises ``ValueError`` for a token id outside the vocabulary or a buffer or state of
        the wrong shape, dtype or length.
        """
        ids = self._check_ids(token_ids)
        positions = [int(p) for p in positions]
        states = self._check_step_states(states, len(ids))
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
        attention = recurrent = 0
        for block, kind in zip(self.blocks, self.cfg.kinds, strict=True):
            if kind == ATTENTION:
                x = block.step(x, bufs, attention, positions, pos)
                attention += 1
            else:
                x = block.step(x, [s[recurrent] for s in states])
                recurrent += 1
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
            return torch.empty(2, cfg.attention_layers, 0, cfg.num_kv_heads, cfg.head_dim,
                               dtype=self.kv_dtype, device=self.device)
        check_kv(past_kv, cfg, field="past_kv")
        return past_kv.to(self.device)

    def _check_state(self, state: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        if state is None:
            return torch.zeros(cfg.recurrent_layers, cfg.hidden_size, device=self.device)
        check_state(state, cfg)
        return state.to(self.device)

    def _check_step_states(self, states: Sequence[torch.Tensor] | None,
                           n: int) -> Sequence[torch.Tensor]:
        if not self.cfg.recurrent_layers:
            return ()
        if states is None or len(states) != n:
            raise ValueError(f"states: a hybrid model steps {n} sequences with one recurrent "
                             f"state each, got {'none' if states is None else len(states)}")
        for i, s in enumerate(states):
            check_state(s, self.cfg, field=f"states[{i}]")
        return states

    def _check_context(self, num_past: int, num_new: int) -> None:
        if num_past + num_new > self.cfg.max_context:
            raise ValueError(f"token_ids: {num_past} cached + {num_new} new tokens exceed the "
                             f"model context {self.cfg.max_context}")


def check_kv(kv: Any, cfg: ModelConfig, *, field: str = "kv") -> None:
    """A contiguous KV tensor ``[2, L, T, Hkv, D]`` of the model's KV dtype, or ValueError."""
    check_tensor(kv, field, kv_torch_dtype(cfg.kv_dtype))
    layers = cfg.attention_layers
    want = (2, layers, None, cfg.num_kv_heads, cfg.head_dim)
    if kv.ndim != 5 or any(w is not None and w != s for w, s in zip(want, kv.shape, strict=True)):
        raise ValueError(f"{field}: expected shape [2, {layers}, T, "
                         f"{cfg.num_kv_heads}, {cfg.head_dim}], got {list(kv.shape)}")


def check_state(state: Any, cfg: ModelConfig, *, field: str = "state") -> None:
    """A float32 recurrent state ``[R, hidden]`` of a hybrid model, or ValueError."""
    check_tensor(state, field, torch.float32)
    want = (cfg.recurrent_layers, cfg.hidden_size)
    if tuple(state.shape) != want:
        raise ValueError(f"{field}: expected shape {list(want)}, got {list(state.shape)}")


def _check_state_at(state_at: Sequence[int], num_new: int) -> list[int]:
    """Row indexes (count - 1) of ``state_at``; ValueError for a count outside 1..T."""
    for i, count in enumerate(state_at):
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= num_new:
            raise ValueError(f"state_at[{i}]: expected a count of new tokens in "
                             f"[1, {num_new}], got {count!r}")
    return [count - 1 for count in state_at]


def sample(logits: torch.Tensor, sampling: SamplingParams, step: int) -> int:
    """Next token from ``logits`` ``[V]``: argmax when greedy, else a seeded draw.

    The draw's generator is seeded from ``(sampling.seed, sampling.first_step + step)``
    alone, so prefill (step 0) and decode (later steps) draw the same tokens in different
    processes, and a resumed answer draws as the whole one would.
    """
    if sampling.greedy:
        return int(torch.argmax(logits))
    step += sampling.first_step
    g = torch.Generator().manual_seed((sampling.seed * 1_000_003 + step) % 2**63)
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=g))


def reference_generate(model: Model, req: Req) -> Generation:
    """Generate with no cache at all: every step reruns the whole sequence from scratch,
    up to ``max_new_tokens`` or a stop token (``req.sampling.stop_token_ids``; kept).

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
        if req.sampling.stops(out):
            break
    return Generation(out, all_logits)


__all__ = [
    "ForwardOutput", "Generation", "Model", "check_kv", "check_state", "reference_generate",
    "sample",
]
