"""The layers of the reference model: RMSNorm, rotary positions, grouped-query attention,
and the gated linear recurrence of hybrid models.

Attention keeps K and V (rounded to the KV dtype as soon as they are produced), so a prefix
is resumed from its KV pages. The recurrence keeps one fixed-size state per layer instead,
so a prefix is resumed from the state after its last token::

    a_t = sigmoid(W_a x_t)      u_t = W_u x_t
    h_t = a_t * h_{t-1} + (1 - a_t) * u_t          (h_{-1} = 0, float32)
    y_t = W_o (h_t * silu(W_g x_t))

The state is updated by the same elementwise steps, one token after the other, in every
path (a whole prompt, a prompt resumed from a cached state, one decode token), so the state
after token t never depends on where a computation started.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pd_cache.core.config import ModelConfig
from pd_cache.kv.pages import kv_torch_dtype
from pd_cache.model.native import attend_native, attend_torch

SCRATCH_BYTES = 32 << 20         # the most one scratch tensor keeps (bytes)
SCRATCH_TOTAL_BYTES = 128 << 20  # the most all threads' scratch of a process keeps (bytes)
SCRATCH_MIN_BYTES = 256 << 10   # smaller projections are made new each time (bytes)


class Scratch(threading.local):
    """Two tensors per thread that a layer writes its intermediates into, forward after
    forward, instead of new ones each time (``pair``).

    New memory is new to the kernel: the first write of each 4 KiB page of it traps and is
    zeroed, and glibc hands back (and later maps again) the top of its heap between
    forwards, so a prompt's MLP intermediates took most of a prefill worker's page faults
    (docs/benchmarks.md, "A prompt's MLP intermediates in scratch"). Per thread, since a
    worker runs forwards on several (prefill's, decode's batching thread and its call
    threads). Each tensor grows to the largest asked of it up to ``limit`` bytes, and all
    threads together keep at most ``total`` bytes; past either, a pair is made for the call
    and dropped as before. A thread's scratch goes when the thread does.
    """

    _lock = threading.Lock()
    _held = 0   # bytes kept by every thread's scratch

    def __init__(self, limit: int = SCRATCH_BYTES, total: int = SCRATCH_TOTAL_BYTES) -> None:
        self.limit, self.total = limit, total
        self.flats: list[torch.Tensor] = []

    def pair(self, rows: int, cols: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Two uninitialised ``[rows, cols]`` tensors of ``like``'s dtype and device; their
        contents are the caller's until its next call on this thread."""
        need = rows * cols
        held = self.flats[0] if self.flats else None
        if held is not None and held.numel() >= need and held.dtype == like.dtype \
                and held.device == like.device:
            return tuple(f[:need].view(rows, cols) for f in self.flats)
        # NOTE: a quarter more than asked: a conversation's next prompt is longer.
        size = min(need + need // 4, self.limit // like.element_size())
        if size < need or not self._reserve(2 * size * like.element_size()):
            return like.new_empty((rows, cols)), like.new_empty((rows, cols))
        self.flats = [like.new_empty(size) for _ in range(2)]
        for flat in self.flats:
            weakref.finalize(flat, Scratch._release, flat.nbytes)
        return tuple(f[:need].view(rows, cols) for f in self.flats)

    def _reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` more kept, less this thread's present pair (dropped on success),
        if that stays within ``total``."""
        mine = sum(f.nbytes for f in self.flats)
        with Scratch._lock:
            if Scratch._held - mine + nbytes > self.total:
                return False
            Scratch._held += nbytes
        self.flats = []   # NOTE: their finalizers give their bytes back
        return True

    @staticmethod
    def _release(nbytes: int) -> None:
        with Scratch._lock:
            Scratch._held -= nbytes

    @classmethod
    def held_bytes(cls) -> int:
        """Bytes every thread's scratch keeps now."""
        return cls._held


SCRATCH = Scratch()


def gated(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
          b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None) -> torch.Tensor:
    """A SwiGLU MLP's inner product ``silu(h W_gate^T + b_gate) * (h W_up^T + b_up)`` for
    ``h`` ``[..., hidden]``, computed in this thread's ``SCRATCH`` (the same values to the bit
    as ``F.linear`` and new tensors); valid until the thread's next call."""
    flat = h.reshape(-1, h.shape[-1])
    if flat.shape[0] * w_gate.shape[0] * flat.element_size() < SCRATCH_MIN_BYTES:
        # NOTE: a decode step's few rows: new tensors cost less than the scratch's Python.
        return F.silu(F.linear(h, w_gate, b_gate)) * F.linear(h, w_up, b_up)
    gate, up = SCRATCH.pair(flat.shape[0], w_gate.shape[0], flat)
    for w, b, out in ((w_gate, b_gate, gate), (w_up, b_up, up)):
        if b is None:
            torch.mm(flat, w.t(), out=out)
        else:
            torch.addmm(b, flat, w.t(), out=out)
    return F.silu(gate, inplace=True).mul_(up).view(*h.shape[:-1], w_gate.shape[0])


def weight(g: torch.Generator, rows: int, cols: int) -> nn.Parameter:
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
        self.wq = weight(g, cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.wk = weight(g, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
        self.wv = weight(g, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
        self.wo = weight(g, cfg.hidden_size, cfg.num_heads * cfg.head_dim)

    def forward(self, x: torch.Tensor, past: torch.Tensor,
                how: PrefixMask) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` after ``past`` ``[2, P, Hkv, D]`` -> output, new KV;
        ``how`` is ``prefix_mask(T, P)``."""
        t, start = x.shape[0], past.shape[1]
        q = self.rotary(F.linear(x, self.wq).view(t, self.num_heads, self.head_dim), start)
        k = self.rotary(F.linear(x, self.wk).view(t, self.num_kv_heads, self.head_dim), start)
        v = F.linear(x, self.wv).view(t, self.num_kv_heads, self.head_dim)
        out, new = attend_prefix(q, k, v, past, self.kv_dtype, how)
        return F.linear(out, self.wo), new

    def step(self, x: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
             positions: list[int], pos: torch.Tensor) -> torch.Tensor:
        """One new token per sequence: ``x`` ``[B, hidden]``; row ``b`` is at position
        ``positions[b]`` of ``bufs[b]`` ``[2, L, >P, Hkv, D]``, whose KV it writes there and
        then attends over (keys ``0 .. positions[b]``)."""
        b = x.shape[0]
        q = self.rotary.at(F.linear(x, self.wq).view(b, self.num_heads, self.head_dim), pos)
        k = self.rotary.at(F.linear(x, self.wk).view(b, self.num_kv_heads, self.head_dim), pos)
        v = F.linear(x, self.wv).view(b, self.num_kv_heads, self.head_dim)
        new = torch.stack([k, v], dim=1).to(self.kv_dtype)   # [B, 2, Hkv, D]
        return F.linear(attend_step(q, new, bufs, layer, positions), self.wo)


class PrefixMask(NamedTuple):
    """How ``T`` new queries after ``P`` cached keys attend (``prefix_mask``)."""

    mask: torch.Tensor | None = None
    causal: bool = False


def prefix_mask(t: int, start: int, device: torch.device | str = "cpu") -> PrefixMask:
    """Query ``i`` (position ``start + i``) sees keys ``0 .. start + i``; built once per
    forward and shared by every layer. One query sees every key (no mask); with no cached
    prefix that is SDPA's own causal flag (the same values to the bit, and blocks above the
    diagonal skipped: about half the attention of a whole prompt); else an additive float
    mask (a boolean one is converted to it inside every call)."""
    if t == 1:
        return PrefixMask()
    if start == 0:
        return PrefixMask(causal=True)
    keys = torch.arange(start + t, device=device)
    sees = keys[None, :] <= (torch.arange(t, device=device) + start)[:, None]
    return PrefixMask(torch.zeros(sees.shape, device=device).masked_fill_(~sees, -math.inf))


def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor,
                  kv_dtype: torch.dtype, how: PrefixMask) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` ``[T, H, D]`` over ``past`` ``[2, P, Hkv, D]`` and their own keys and
    values ``k``, ``v`` ``[T, Hkv, D]`` -> output ``[T, H * D]``, new KV ``[2, T, Hkv, D]``."""
    # NOTE: round to the storage dtype before attending, so the cached and uncached paths
    # attend over exactly the same values.
    new = torch.stack([k, v]).to(kv_dtype)
    kv = torch.cat([past.float(), new.float()], dim=1)
    # NOTE: 4-D inputs [1, H, T, D]: on CPU only those take the fused kernel (3-D ones fall
    # back to the math path, ~6x slower).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None],
        attn_mask=how.mask, is_causal=how.causal, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1), new


class Recurrence(nn.Module):
    """The gated linear recurrence of the module docstring; its state is ``[hidden]``."""

    def __init__(self, cfg: ModelConfig, g: torch.Generator) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.w_a, self.w_u = weight(g, h, h), weight(g, h, h)
        self.w_g, self.w_o = weight(g, h, h), weight(g, h, h)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` after ``state`` ``[hidden]`` -> output, and the state after
        each token ``[T, hidden]`` (the last row is the new state)."""
        a, b = self._gates(x)
        states = torch.empty_like(x)
        h = state
        for t in range(x.shape[0]):
            h = a[t] * h + b[t]
            states[t] = h
        return self._out(x, states), states

    def step(self, x: torch.Tensor, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """One new token per sequence: ``x`` ``[B, hidden]``; ``states[b]`` ``[hidden]`` is
        sequence ``b``'s state, advanced in place."""
        a, b = self._gates(x)
        for i, h in enumerate(states):
            h.copy_(a[i] * h + b[i])
        return self._out(x, torch.stack(list(states)))

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.sigmoid(F.linear(x, self.w_a))
        return a, (1 - a) * F.linear(x, self.w_u)

    def _out(self, x: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        return F.linear(states * F.silu(F.linear(x, self.w_g)), self.w_o)


def attend_step(q: torch.Tensor, new: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
                positions: list[int]) -> torch.Tensor:
    """One decode step of attention for ``B`` sequences, each over its own buffer: writes
    row ``b``'s new K and V (``new[b]`` ``[2, Hkv, D]``) at ``positions[b]`` of ``bufs[b]``
    and attends query ``q[b]`` ``[H, D]`` over keys ``0 .. positions[b]``; ``[B, H * D]``."""
    for i, (buf, p) in enumerate(zip(bufs, positions, strict=True)):
        buf[:, layer, p] = new[i]
    fast = attend_native(q, bufs, layer, positions)   # float32 KV, an AVX2 CPU
    if fast is not None:
        return fast
    group = q.shape[1] // new.shape[2]
    return torch.cat([attend_torch(q[i], buf[:, layer, :p + 1], group)
                      for i, (buf, p) in enumerate(zip(bufs, positions, strict=True))]
                     ).reshape(q.shape[0], -1)
