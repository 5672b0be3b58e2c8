"""Decode's attention step in C (``pd_cache/model/_attend.c``), where it can serve.

A decode step attends one new query per sequence over that sequence's whole KV: for the
``small`` model at about 2,000 tokens, 32 calls of ``scaled_dot_product_attention`` a step
(one per sequence and layer) took about half the step. The C loop reads each KV head's rows
once for all the query heads that share it, in blocks that stay in cache while they do,
and runs the whole batch of a layer in one call with the GIL released: about half the
time of those calls (`benchmarks/bench_decode_attention.py`).

It serves float32 KV whose rows are laid out as the decode buffers are (``[.., T, Hkv, D]``,
contiguous rows), head sizes a multiple of 8 up to 128, on a CPU with AVX2 and FMA.
Anything else (another KV dtype, a non-AVX2 CPU, no compiler at install time) keeps
torch's kernel, as does a build whose answer on a probe differs from torch's beyond
float32 rounding. Its sums run in another order than torch's, so the two agree to about
1e-6 relative, not to the bit; every path of one process uses the same kernel, so a
cached and an uncached decode still draw the same tokens.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ENV = "PD_CACHE_NATIVE_ATTENTION"   # "0": keep torch's kernel everywhere
MAX_HEAD_DIM = 128
TOLERANCE = 1e-5   # the probe's largest difference from torch's, relative to its output


def probe(attend: Callable[..., None]) -> float:
    """The largest difference of ``attend`` from ``scaled_dot_product_attention`` over a
    small batch (lengths around one block of 8, a grouped and an ungrouped head layout),
    relative to the output's largest value."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for kv_heads, group, dim, lens in ((2, 4, 32, (1, 7, 8, 9, 70)), (3, 1, 16, (5, 64))):
        bufs = [torch.randn(2, 1, n + 3, kv_heads, dim, generator=g) for n in lens]
        q = torch.randn(len(lens), kv_heads * group, dim, generator=g)
        want = torch.cat([attend_torch(q[i], buf[:, 0, :n], group)
                          for i, (buf, n) in enumerate(zip(bufs, lens, strict=True))])
        got = torch.empty_like(q)
        attend(q.data_ptr(), got.data_ptr(), [b[0, 0].data_ptr() for b in bufs],
               [b[1, 0].data_ptr() for b in bufs], list(lens), kv_heads, group, dim,
               kv_heads * dim)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
    return worst


def attend_torch(q: torch.Tensor, kv: torch.Tensor, group: int) -> torch.Tensor:
    """Torch's kernel for one sequence: query ``q`` ``[H, D]`` over ``kv`` ``[2, T, Hkv, D]``
    -> ``[1, H, D]``. What serves where the C kernel does not, and what the probe checks
    it against."""
    kv = kv.float().transpose(1, 2)   # [2, Hkv, T, D]
    # NOTE: one query token: the ``group`` query heads of a KV head are folded into the
    # query rows of that head (``[1, Hkv, group, D]``), so no mask and no GQA expansion.
    out = F.scaled_dot_product_attention(q.view(1, kv.shape[1], group, q.shape[-1]),
                                         kv[0:1], kv[1:2])
    return out.reshape(1, -1, q.shape[-1])


@functools.cache
def kernel() -> Callable[..., None] | None:
    """The C kernel, if it is built, this CPU runs it and it agrees with torch on the probe;
    else ``None``. Checked once per process."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        from pd_cache.model import _attend  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        worst = probe(_attend.attend)
    except (RuntimeError, ValueError) as e:   # no AVX2 / FMA on this CPU
        log.info("decode attention: torch's kernel (%s)", e)
        return None
    if worst > TOLERANCE:
        log.warning("decode attention: the C kernel differs from torch's by %.2g on the "
                    "probe; torch's kernel serves", worst)
        return None
    return _attend.attend


def attend_native(q: torch.Tensor, bufs: Sequence[torch.Tensor], layer: int,
                  positions: Sequence[int]) -> torch.Tensor | None:
    """Query ``q[b]`` ``[H, D]`` over keys ``0 .. positions[b]`` of ``bufs[b]``'s layer
    ``layer`` (``[2, L, > P, Hkv, D]``) -> ``[B, H * D]``, in C; ``None`` where the kernel
    cannot serve (see the module docstring), for the caller to use torch's."""
    attend = kernel()
    if attend is None or not bufs or q.dtype != torch.float32 or q.device.type != "cpu":
        return None
    kv_heads, dim = bufs[0].shape[3], bufs[0].shape[4]
    if q.shape != (len(bufs), q.shape[1], dim) or len(positions) != len(bufs):
        raise ValueError(f"attend_native: queries {tuple(q.shape)} for {len(bufs)} buffers "
                         f"of head size {dim} and {len(positions)} positions")
    if dim % 8 or dim > MAX_HEAD_DIM or q.shape[1] % kv_heads:
        return None
    for buf, p in zip(bufs, positions, strict=True):
        if not 0 <= p < buf.shape[2]:
            raise ValueError(f"attend_native: position {p} is outside a buffer of "
                             f"{buf.shape[2]} tokens")
        if (buf.dtype != torch.float32 or buf.device.type != "cpu"
                or buf.shape[3:] != (kv_heads, dim)
                or buf.stride()[2:] != (kv_heads * dim, dim, 1)):
            return None
    q = q.contiguous()
    out = torch.empty_like(q)
    attend(q.data_ptr(), out.data_ptr(), [b[0, layer].data_ptr() for b in bufs],
           [b[1, layer].data_ptr() for b in bufs], [p + 1 for p in positions], kv_heads,
           q.shape[1] // kv_heads, dim, kv_heads * dim)
    return out.reshape(q.shape[0], -1)


__all__ = ["attend_native", "attend_torch", "kernel", "probe"]
