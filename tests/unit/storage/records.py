"""Page records and chains of them for the storage tests: a layout, arbitrary payload bits,
one page's record, a namespace's chain of records, and a bit-exact comparison.
"""

from __future__ import annotations

import numpy as np
import torch

from pd_cache.core.config import KVLayout
from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.storage import PageRecord, make_record

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def layout_for(dtype: torch.dtype = torch.float32, **kw: object) -> KVLayout:
    fields: dict[str, object] = {"model_id": "test", "kv_dtype": str(dtype).removeprefix("torch."),
                                 "num_layers": 2, "page_size": 4, "num_kv_heads": 2,
                                 "head_dim": 8}
    return KVLayout(**{**fields, **kw})


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included) so equality is bit-exact."""
    gen = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def page(layout: KVLayout, seed: int = 0, extra_key: str | None = None,
         dtype: torch.dtype | None = None) -> PageRecord:
    dtype = dtype or getattr(torch, layout.kv_dtype)
    tokens = list(range(seed, seed + layout.page_size))
    name = page_hashes(tokens, layout.page_size, extra_key=extra_key)[0]
    prior = namespace_seed(extra_key, None)
    return make_record(name, prior, tokens, {"kv": random_bits(layout.page_shape, dtype, seed)},
                       fingerprint=layout.fingerprint)


class Chain:
    """A namespace's pages: tokens, names, priors and one record per page and pool."""

    def __init__(self, layout: KVLayout, n: int, *, extra_key: str | None = None,
                 seed: int = 0, state_shape: tuple[int, ...] | None = None,
                 shared: tuple[Chain, int] | None = None) -> None:
        """``shared=(other, k)``: the first ``k`` pages are ``other``'s (a common prefix)."""
        gen = torch.Generator().manual_seed(seed)
        self.layout, self.extra_key = layout, extra_key
        self.tokens = torch.randint(0, 50_000, (n * layout.page_size,), generator=gen).tolist()
        if shared is not None:
            k = shared[1] * layout.page_size
            self.tokens[:k] = shared[0].tokens[:k]
        self.seed = namespace_seed(extra_key, None)
        self.names = page_hashes(self.tokens, layout.page_size, extra_key=extra_key)
        self.priors = [self.seed, *self.names[:-1]]
        kv_dtype = getattr(torch, layout.kv_dtype)
        self.records = [self.record(i, {"kv": random_bits(layout.page_shape, kv_dtype,
                                                          seed * 1000 + i)}) for i in range(n)]
        self.states = [] if state_shape is None else [
            self.record(i, {"state": random_bits(state_shape, torch.bfloat16, 7 + i)})
            for i in range(n)]

    def record(self, i: int, pools: dict[str, torch.Tensor]) -> PageRecord:
        ps = self.layout.page_size
        return make_record(self.names[i], self.priors[i], self.tokens[i * ps:(i + 1) * ps],
                           pools, fingerprint=self.layout.fingerprint)


def assert_same(got: PageRecord | None, want: PageRecord) -> None:
    assert got is not None
    assert got.header == want.header
    for a, b in zip(got.payloads, want.payloads):
        assert a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
