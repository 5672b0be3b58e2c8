"""``DecodeOffloadManager``: the decode side's writes to L3.

Each time ``stride`` new tokens (8 pages by default) have filled whole pages, and when the
request ends, decode backs those pages up. Their names continue the prompt's chain from the
last name written, so they equal the names a prefill of ``prompt + output`` computes, and
the next turn of a conversation finds them. The first write also carries the prompt's full
pages that L3 lacks: past the ``l3_pages`` prefill said L3 holds once its own write lands
(from a page index or what that worker stored or read), with no question asked; when
prefill could not say, one query and then everything missing from there on. A request's
writes are one call per shard instead of one per page::

    prompt  |p0|p1|p2|p3 ..|          names h1 h2 h3 (p3 partial: no name yet)
    decode  |p0|p1|p2|p3 +out|o1 ..|  h4 = H(h3 || tokens of page 4), h5 = H(h4 || ..)

Only pages whose every token has KV are written (decode never computes the KV of the
last token it draws). All writes go through the controller's writer (its background
thread).

A pinning request's writes pin its prompt's pages alone: the generated ones (the page the
answer completes included) are stored unpinned, as decode's own tree keeps them.

A hybrid model's writes carry the recurrent state at their checkpoint pages (every
``state_every`` pages and each write's last page; ``pd_cache.kv.state``): the prompt's
as prefill handed them over, the generated pages' as decode recorded them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pd_cache.core.fields import check_int_at_least
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.vocab import GENERATED, OFFLOAD, PROMPT, SKIPPED
from pd_cache.kv.pages import kv_to_pages
from pd_cache.kv.state import checkpoints
from pd_cache.tiering.controller import CacheController

DEFAULT_STRIDE_PAGES = 8


@dataclass
class OffloadState:
    """One request's progress: the chain names covered so far (the prompt's full pages,
    then the generated pages written), and whether the prompt's pages from ``prompt_start``
    on still wait for the request's first write (with their recurrent states, by page
    index, for a hybrid model); ``ask``: that write first asks L3 where its copy ends."""

    req: Req
    names: list[bytes] = field(default_factory=list)
    prompt_pending: bool = False
    prompt_states: Mapping[int, torch.Tensor] | None = None
    prompt_start: int = 0
    ask: bool = True

    @property
    def num_pages(self) -> int:
        return len(self.names)

    @property
    def last_name(self) -> bytes | None:
        return self.names[-1] if self.names else None


class DecodeOffloadManager:
    """Backs up a decoding request's KV pages to L3 through a ``CacheController``.

    ``stride`` (tokens, default ``DEFAULT_STRIDE_PAGES`` pages) is how many newly
    computed tokens are gathered before their full pages are written. ``min_pages``: the
    request's last write is made only if it sends at least that many pages (fewer are
    counted ``offload/skipped``): one call per page costs more than recomputing the page.
    """

    def __init__(self, controller: CacheController, *, stride: int | None = None,
                 min_pages: int = 1) -> None:
        if not isinstance(controller, CacheController):
            raise ValueError(f"controller: expected a CacheController, got "
                             f"{type(controller).__name__}")
        self.controller = controller
        self.page_size = controller.page_size
        stride = DEFAULT_STRIDE_PAGES * self.page_size if stride is None else stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride: expected an int >= 1 (tokens), got {stride!r}")
        self.stride = stride
        check_int_at_least("min_pages", min_pages, 1)
        self.min_pages = min_pages

    def offload_kv_cache(self, req: Req, names: Sequence[bytes] | None = None,
                         states: Mapping[int, torch.Tensor] | None = None, *,
                         l3_pages: int | None = None) -> OffloadState:
        """Decode starts from the prompt's full pages, ``names`` (as prefill named them;
        ``None``: named here); the request's first write (at the latest
        ``advance(final=True)``) sends those L3 lacks, read from decode's own KV: those
        past ``l3_pages`` (the leading ones L3 holds, as prefill said), or, when that is
        ``None``, past where L3's copy ends, asked then.

        ``states`` (hybrid): the recurrent state after some of the prompt's pages, by page
        index (kept until that write copies them). Raises ``ValueError`` if ``names`` are
        not one per full page of the prompt.
        """
        full = len(req.input_ids) // self.page_size
        if names is None:
            names = compute_prefix_hash(req, req.input_ids[:full * self.page_size],
                                        page_size=self.page_size, algo=self.controller.algo)
        elif len(names) != full:
            raise ValueError(f"names: {len(names)} page names for a prompt of {full} full "
                             f"pages (request {req.rid!r})")
        start = 0 if l3_pages is None else min(max(l3_pages, 0), full)
        return OffloadState(req, list(names), prompt_pending=start < len(names),
                            prompt_states=states, prompt_start=start, ask=l3_pages is None)

    def advance(self, state: OffloadState, tokens: list[int], kv: torch.Tensor,
                num_computed: int, *, final: bool = False,
                page_states: Mapping[int, torch.Tensor] | None = None) -> int:
        """``kv`` ``[2, L, >= num_computed, Hkv, D]`` now holds the KV of the first
        ``num_computed`` of ``tokens`` (``prompt + output`` so far): once ``stride`` tokens
        wait past the pages already written (or ``final``), write the full pages among
        them, with the states of ``page_states`` (by page index; hybrid) at their
        checkpoints. The first write starts at the prompt's first page L3 lacks. Returns
        the number of generated pages sent."""
        ps, done = self.page_size, state.num_pages
        full = num_computed // ps
        waiting = num_computed - done * ps
        if (full <= done and not (final and state.prompt_pending)) \
                or (waiting < self.stride and not final):
            return 0
        start = state.prompt_start if state.prompt_pending else done
        if final and max(full, done) - start < self.min_pages:
            # NOTE: a lone answer page: its set call costs more CPU than its recompute.
            self.controller.stats.count(OFFLOAD, SKIPPED, max(full, done) - start)
            state.prompt_pending, state.prompt_states = False, None
            return 0
        new = compute_prefix_hash(state.req, tokens[done * ps:full * ps], state.last_name,
                                  page_size=ps, algo=self.controller.algo) \
            if full > done else []
        states = {i - start: page_states[i]
                  for i in checkpoints(done, full - 1, self.controller.state_every)
                  if page_states and i in page_states}
        if state.prompt_pending:
            states.update((i - start, s) for i, s in (state.prompt_states or {}).items()
                          if start <= i < done)
        # NOTE: kv_to_pages makes the pages for this call alone: no snapshot needed.
        self.controller.writer.backup(
            state.req, state.names[start:] + new, tokens[start * ps:max(full, done) * ps],
            kv_to_pages(kv[:, :, start * ps:max(full, done) * ps], ps), state.names[:start],
            skip_stored=state.prompt_pending and state.ask, kind=OFFLOAD,
            page_kinds=[PROMPT] * (done - start) + [GENERATED] * len(new), copy=False,
            states=states, pinned=done - start)
        state.names = state.names + new
        state.prompt_pending, state.prompt_states = False, None
        return len(new)
