"""Page tensors: the layout checks and the contiguous <-> paged conversions.

KV layouts (K/V, layer, token, kv head, head dim)::

    contiguous  [2, L, T, Hkv, D]
    pages       [n, 2, L, page_size, Hkv, D]   token t -> page t // page_size, row t % page_size

A trailing partial page is zero past the last token; ``pages_to_kv`` takes the token count.
"""

from __future__ import annotations

from typing import Any

import torch

from pd_cache.core.config import KVLayout

KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}


def kv_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``kv_dtype`` config string."""
    if name not in KV_TORCH_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {sorted(KV_TORCH_DTYPES)}, got {name!r}")
    return KV_TORCH_DTYPES[name]


def check_pages(pages: Any, layout: KVLayout, *, field: str = "pages",
                num_pages: int | None = None) -> None:
    """A page tensor ``[n, *layout.page_shape]`` of the layout's dtype, or ValueError."""
    check_tensor(pages, field, kv_torch_dtype(layout.kv_dtype))
    if pages.ndim != 6 or tuple(pages.shape[1:]) != layout.page_shape:
        raise ValueError(f"{field}: expected shape [n, {', '.join(map(str, layout.page_shape))}]"
                         f", got {list(pages.shape)}")
    if num_pages is not None and pages.shape[0] != num_pages:
        raise ValueError(f"{field}: expected {num_pages} pages, got {pages.shape[0]}")


def check_tensor(t: Any, field: str, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{field}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{field}: expected dtype {dtype}, got {t.dtype}")


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` (the last one possibly partial)."""
    return -(-num_tokens // page_size)


def page_view(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """The full pages of ``kv`` ``[2, L, T, Hkv, D]`` as a strided view ``[T // ps, 2, L, ps,
    Hkv, D]`` of it, no copy (a partial last page left out): for a reader that copies only
    the pages it takes, such as a radix insert of pages mostly cached already."""
    full = kv.shape[2] // page_size
    return kv[:, :, :full * page_size].unflatten(2, (full, page_size)).permute(2, 0, 1, 3, 4, 5)


def kv_to_pages(kv: torch.Tensor, page_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous ``[2, L, T, Hkv, D]`` -> pages ``[ceil(T/ps), 2, L, ps, Hkv, D]``, zero-padded.

    ``out`` (optional): a contiguous tensor of that shape and of ``kv``'s dtype to fill, such
    as the tail of a request's page tensor; filled with one strided copy, no temporary.
    """
    two, layers, t, heads, dim = kv.shape
    n, full = num_pages_for(t, page_size), t // page_size
    shape = (n, two, layers, page_size, heads, dim)
    if out is None:
        out = kv.new_empty(shape)
    elif tuple(out.shape) != shape or out.dtype != kv.dtype or not out.is_contiguous():
        raise ValueError(f"kv_to_pages: out: expected a contiguous {kv.dtype} tensor "
                         f"{list(shape)}, got {out.dtype} {list(out.shape)}")
    out[:full].copy_(page_view(kv, page_size))
    if full < n:
        rest = t - full * page_size
        out[full, :, :, :rest].copy_(kv[:, :, full * page_size:])
        out[full, :, :, rest:].zero_()
    return out


def pages_to_kv(pages: torch.Tensor, num_tokens: int, layout: KVLayout,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Pages ``[n, *page_shape]`` holding ``num_tokens`` tokens -> contiguous KV.

    ``out`` (optional): a contiguous ``[2, L, T', Hkv, D]`` tensor of the pages' dtype with
    ``T' >= num_tokens``, such as a sequence's whole KV buffer: its first ``num_tokens``
    tokens are filled with strided copies, no temporary, and returned (a view of ``out``).

    Raises ``ValueError`` if the pages have the wrong shape or dtype, if ``n`` is not
    the number of pages that ``num_tokens`` tokens fill, or if ``out`` does not fit.
    """
    check_pages(pages, layout, num_pages=num_pages_for(num_tokens, layout.page_size))
    n, two, layers, ps, heads, dim = pages.shape
    if out is None:
        return pages.permute(1, 2, 0, 3, 4, 5).reshape(two, layers, n * ps, heads,
                                                      dim)[:, :, :num_tokens]
    fits = (out.ndim == 5 and out.shape[2] >= num_tokens and out.dtype == pages.dtype
            and (*out.shape[:2], *out.shape[3:]) == (two, layers, heads, dim))
    if not fits or not out.is_contiguous():
        raise ValueError(f"pages_to_kv: out: expected a contiguous {pages.dtype} tensor "
                         f"[{two}, {layers}, >= {num_tokens}, {heads}, {dim}], got "
                         f"{out.dtype} {list(out.shape)}")
    full = num_tokens // ps
    page_view(out[:, :, :full * ps], ps).copy_(pages[:full])
    if full < n:
        out[:, :, full * ps:num_tokens].copy_(pages[full, :, :, :num_tokens - full * ps])
    return out[:, :, :num_tokens]
