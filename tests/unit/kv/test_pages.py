"""Contiguous <-> paged KV: the one-copy ``kv_to_pages`` (into a fresh tensor or ``out``)."""

from __future__ import annotations

import pytest
import torch

from pd_cache.kv import kv_to_pages


def reference_pages(kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """The obvious construction: zero-pad to whole pages, then move the page axis first."""
    two, layers, t, heads, dim = kv.shape
    n = -(-t // page_size)
    padded = kv.new_zeros(two, layers, n * page_size, heads, dim)
    padded[:, :, :t] = kv
    return padded.view(two, layers, n, page_size, heads, dim).permute(2, 0, 1, 3, 4, 5) \
        .contiguous()


@pytest.mark.parametrize("tokens", [0, 1, 3, 4, 5, 12, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_to_pages_matches_the_padded_reference(tokens: int, dtype: torch.dtype) -> None:
    kv = torch.randn(2, 3, tokens + 2, 2, 4).to(dtype)[:, :, 2:]   # a strided view
    pages = kv_to_pages(kv, 4)
    assert pages.is_contiguous() and torch.equal(pages, reference_pages(kv, 4))
    buf = torch.full((pages.shape[0] + 2, *pages.shape[1:]), 7.0, dtype=dtype)
    got = kv_to_pages(kv, 4, out=buf[1:-1])            # the tail of a bigger page tensor
    assert got.data_ptr() == buf[1:-1].data_ptr()
    assert torch.equal(buf[1:-1], pages)                # the partial page's padding is zeroed
    assert bool((buf[0] == 7).all()) and bool((buf[-1] == 7).all())


def test_kv_to_pages_refuses_an_out_that_does_not_fit() -> None:
    kv = torch.randn(2, 1, 6, 1, 2)
    with pytest.raises(ValueError, match=r"out: expected a contiguous torch.float32 tensor "
                                         r"\[2, 2, 1, 4, 1, 2\]"):
        kv_to_pages(kv, 4, out=torch.empty(3, 2, 1, 4, 1, 2))
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        kv_to_pages(kv, 4, out=torch.empty(2, 2, 1, 4, 1, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        kv_to_pages(kv, 4, out=torch.empty(2, 2, 1, 4, 2, 2)[:, :, :, :, :1])
