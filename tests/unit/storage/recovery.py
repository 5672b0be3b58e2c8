"""The review's attack on stored KV: layer 0's V rows depend only on the token, so with the
model's weights a plain page gives its prompt back. Shared by the sealed-L3 tests."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from pd_cache.core.config import KVLayout
from pd_cache.model.model import Model
from pd_cache.storage.disk import DiskBackend
from pd_cache.storage.record import DTYPES, PageRecord


def vocabulary_v_rows(model: Model) -> torch.Tensor:
    """Layer 0's V row of every vocabulary id, [vocab, Hkv * D], as the cache stores it
    (layer 0's V depends on the token alone)."""
    block = model.blocks[0]
    with torch.no_grad():
        v = torch.nn.functional.linear(block.attn_norm(model.embed), block.attn.wv)
    return v.to(model.kv_dtype).float()


def recover(payload: torch.Tensor, table: torch.Tensor, page_shape: tuple[int, ...],
            dtype: torch.dtype) -> list[int | None]:
    """The review's attack: read a stored payload as a KV page, match each of layer 0's V
    rows against every vocabulary id's; the id whose row equals it, if one does."""
    n = DTYPES[str(dtype).removeprefix("torch.")].itemsize * math.prod(page_shape)
    raw = payload.contiguous().view(torch.uint8).reshape(-1)[:n]
    page = raw.view(dtype).view(page_shape).float()
    rows = page[1, 0].reshape(page_shape[2], -1)   # V, layer 0, one row per token
    out: list[int | None] = []
    for row in rows:
        dist = (table - row).abs().amax(dim=1)
        best = int(dist.argmin())
        out.append(best if float(dist[best]) == 0.0 else None)
    return out


def stolen_records(root: Path, copy_to: Path, layout: KVLayout) -> list[PageRecord]:
    """Every record under a disk L3's ``root``, as a thief with a copy of its files and no
    key reads them (the store's own checks: only whole, well-formed records)."""
    shutil.copytree(root, copy_to)
    out: list[PageRecord] = []
    for shard in sorted(copy_to.glob("shard-*")):
        store = DiskBackend(shard, layout, 1 << 40, fsync=False)
        names = [path.name.split(".")[0] for path in shard.rglob("*.rec")]
        out.extend(r for r in store.batch_get(names) if r is not None)
    return out
