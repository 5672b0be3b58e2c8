"""What the engine hands out: a prefill's output (``PrefillOutput``, with a hybrid
prompt's recurrent state, ``PromptState``; a prefill worker's, ``PrefillResult``;
``Answered``: either, with what follows it), a finished request (``Result``) and a
request being decoded (``DecodeSeq``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pd_cache.core.config import KVLayout
from pd_cache.core.request import Req
from pd_cache.core.wire import PrefillInfo
from pd_cache.kv.state import check_states
from pd_cache.tiering.offload import OffloadState

log = logging.getLogger(__name__)


class PromptState(NamedTuple):
    """A hybrid prompt's recurrent state, as prefill hands it to decode: ``final`` after the
    last prompt token ``[*state_shape]``, and ``pages[i]`` after page ``i`` for the
    checkpoint pages prefill knows (what decode writes to L3 with the prompt's KV).

    On the wire it is one tensor ``[len(pages) + 1, *state_shape]`` (``pack``): the page
    states in ``page_ids`` order, then ``final``.
    """

    final: torch.Tensor
    pages: dict[int, torch.Tensor]

    def pack(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        ids = tuple(sorted(self.pages))
        return torch.stack([*(self.pages[i] for i in ids), self.final]), ids

    @classmethod
    def unpack(cls, stacked: Any, page_ids: Sequence[int], layout: KVLayout) -> PromptState:
        """The state ``pack`` made; ``ValueError`` naming what does not fit ``layout``."""
        check_states(stacked, layout, field="handoff states", num=len(page_ids) + 1)
        return cls(stacked[-1], {int(i): stacked[k] for k, i in enumerate(page_ids)})


class PrefillOutput(NamedTuple):
    """What prefill hands to decode.

    ``kv_pages`` ``[ceil(n / page_size), *page_shape]`` hold the prompt's KV (the last
    page zero past token ``n``); ``page_names`` name its full pages; ``cached_tokens``
    counts prompt tokens served from each tier (``device``, ``host``, ``storage``);
    ``logits`` ``[vocab]`` are those ``first_token`` was drawn from; ``seed`` is the
    request's namespace seed (the KV's producer, for the reader's audit);
    ``cross_namespace_pages`` counts cached pages refused because another namespace
    produced them (recomputed instead; 0 unless a lookup is wrong); ``state`` is a hybrid
    prompt's recurrent state (``None`` for a plain model); ``l3_pages``: the prompt's
    leading pages L3 holds once this prefill's write lands (``None``: unknown).
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
    state: PromptState | None = None
    l3_pages: int | None = None


class PrefillResult(NamedTuple):
    """A prefill worker's answer: what decode needs (``kv_pages`` after the pages it kept;
    ``states``: a hybrid prompt's, ``None`` when plain)."""

    info: PrefillInfo
    kv_pages: torch.Tensor
    states: torch.Tensor | None = None


class Answered(NamedTuple):
    """A prefill's answer (``output``: a ``PrefillOutput``, or a worker's ``PrefillResult``)
    and the work that may follow it (``after``: the L3 write-through, then a worker's
    metrics), which the caller runs once the answer is on its way."""

    output: Any
    after: Callable[[], None]


class Result(NamedTuple):
    """A finished request: generated tokens, cached prompt tokens by tier, first logits."""

    rid: str
    output_ids: list[int]
    cached_tokens: dict[str, int]
    first_logits: torch.Tensor


@dataclass(eq=False)
class DecodeSeq:
    """One request being decoded: its KV buffer, where the next token's KV goes, the
    tokens drawn so far (``seq`` = prompt + tokens, kept for offload naming). A hybrid
    model's: its recurrent state after ``pos`` tokens (``recurrent``, advanced in place)
    and, while it offloads, the state after each page completed since the last write
    (``page_states``); what decode's prefix cache keeps of it (``kept_states``)."""

    req: Req
    buf: torch.Tensor
    pos: int
    tokens: list[int]
    seq: list[int]
    state: OffloadState | None
    recurrent: torch.Tensor | None = None
    page_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # NOTE: for decode's prefix cache (``DecodeCache.keep``): a hybrid model's states at
    # checkpoint pages, and whether the sequence's pages went into the cache already.
    kept_states: dict[int, torch.Tensor] = field(default_factory=dict)
    kept: bool = False
    ended: bool = False   # stopped: ``buf`` went back to the engine's buffers

    @property
    def done(self) -> bool:
        """``max_new_tokens`` drawn, or the last one drawn is a stop token."""
        return self.req.answered_by(self.tokens)


def pages_in(n: Any, full: int) -> bool:
    """Whether ``n`` is a page count of a prompt of ``full`` full pages."""
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= full


def answered_kept(kept: Any, full: int, rid: str) -> int:
    """Decode's answer to a reservation, 0 if it is not a page count of this prompt."""
    if pages_in(kept, full):
        return int(kept)
    log.error("request %s: decode reserved %r pages of a %d-page prompt; a full handoff",
              rid, kept, full)
    return 0
