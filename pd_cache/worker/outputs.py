"""What the engine hands out: a prefill's output (``PrefillOutput``, with what L3
supplied, ``StoredPages``), a finished request (``Result``) and a request being decoded
(``DecodeSeq``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pd_cache.core.request import Req
from pd_cache.tiering.offload import OffloadState


class PrefillOutput(NamedTuple):
    """What prefill hands to decode.

    ``kv_pages`` ``[ceil(n / page_size), *page_shape]`` hold the prompt's KV (the last
    page zero past token ``n``); ``page_names`` name its full pages; ``cached_tokens``
    counts prompt tokens served from each tier (``device``, ``host``, ``storage``);
    ``logits`` ``[vocab]`` are those ``first_token`` was drawn from; ``seed`` is the
    request's namespace seed (the KV's producer, for the reader's audit);
    ``cross_namespace_pages`` counts cached pages refused because another namespace
    produced them (recomputed instead; 0 unless a lookup is wrong).
    """

    rid: str
    first_token: int
    kv_pages: torch.Tensor
    num_prompt_tokens: int
    page_names: tuple[bytes, ...]
    cached_tokens: dict[str, int]
    logits: torch.Tensor
    seed: bytes = b""
    cross_namespace_pages: int = 0


class StoredPages(NamedTuple):
    """What L3 supplied: ``pages`` for the leading names, and the pages it offered that
    another namespace had produced (refused)."""

    pages: torch.Tensor
    cross_namespace: int = 0


class Result(NamedTuple):
    """A finished request: generated tokens, cached prompt tokens by tier, first logits."""

    rid: str
    output_ids: list[int]
    cached_tokens: dict[str, int]
    first_logits: torch.Tensor


@dataclass(eq=False)
class DecodeSeq:
    """One request being decoded: its KV buffer, where the next token's KV goes, the
    tokens drawn so far (``seq`` = prompt + tokens, kept for offload naming)."""

    req: Req
    buf: torch.Tensor
    pos: int
    tokens: list[int]
    seq: list[int]
    state: OffloadState | None

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.req.max_new_tokens
