"""The decode half of ``LocalEngine``: a prompt's KV (and a hybrid model's recurrent
state) handed over by prefill, stepped token by token, alone or batched with others::

    start_decode   check the handoff, copy KV and state into private buffers, start offload
    decode_step    one token for every sequence in one forward; offload filled pages
    finish_decode  offload the last full pages; the tokens
    stop_decode    offload what a sequence dropped early computed

A hybrid sequence also records the state after each page it fills until an offload write
has taken it (the write keeps those at its checkpoints, ``pd_cache.kv.state``).

With a ``keeper`` (a decode worker's prefix cache, ``pd_cache.worker.decode_cache``) a
sequence's full pages, and a hybrid one's states at checkpoints, go into the radix cache
when it ends, however it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from pd_cache.core.config import KVLayout, PDCacheConfig
from pd_cache.core.request import Req
from pd_cache.core.stats import Stats
from pd_cache.core.vocab import DECODE
from pd_cache.kv import PagePool
from pd_cache.kv.pages import kv_to_pages, pages_to_kv
from pd_cache.kv.state import checkpoints
from pd_cache.model.model import Model, sample
from pd_cache.model.model import check_state as check_model_state
from pd_cache.tiering.offload import DecodeOffloadManager
from pd_cache.worker.buffers import Buffers
from pd_cache.worker.cores import Cores
from pd_cache.worker.outputs import DecodeSeq, PromptState

log = logging.getLogger(__name__)
Keeper = Callable[[Req, list[int], torch.Tensor, int, Mapping[int, torch.Tensor]], None]


class Decoding:
    """What ``LocalEngine`` decodes with (its model, pools and offload manager)."""

    config: PDCacheConfig
    model: Model
    page_size: int
    stats: Stats
    device_pool: PagePool
    state_every: int
    offload: DecodeOffloadManager | None
    layout: KVLayout
    keeper: Keeper | None = None
    cores: Cores
    buffers: Buffers

    def _check_request(self, req: Req) -> None:
        req.check_model(vocab_size=self.config.model.vocab_size,
                        max_context=self.config.model.max_context)

    def compute_prompt(self, req: Req) -> tuple[torch.Tensor, int, PromptState | None]:
        """The prompt's KV pages, first token and (hybrid) state computed from scratch, no
        cache touched (what decode falls back to when handed-off KV fails its audit)."""
        self._check_request(req)
        full = len(req.input_ids) // self.page_size
        at = checkpoints(0, full - 1, self.state_every) if self.layout.has_state else []
        with self.cores.forward(len(req.input_ids)):
            out = self.model(req.input_ids, None,
                             state_at=[(i + 1) * self.page_size for i in at])
        state = None if out.state is None else PromptState(out.state, dict(zip(at, out.states)))
        return (kv_to_pages(out.kv, self.page_size), sample(out.logits[-1], req.sampling, 0),
                state)

    def decode(self, req: Req, prompt_kv_pages: torch.Tensor, num_prompt_tokens: int,
               first_token: int, state: PromptState | None = None,
               names: Sequence[bytes] | None = None, l3_pages: int | None = None) -> list[int]:
        """Generate up to ``req.max_new_tokens`` tokens after the prompt (fewer when one is a
        stop token of ``req.sampling``); fills ``req.output_ids``.

        ``prompt_kv_pages`` (and a hybrid prompt's ``state``) are treated as read-only
        (they may be a shared-memory view). Raises ``ValueError`` if they have the wrong
        shape, dtype or page count, if a hybrid model gets no state, or if
        ``num_prompt_tokens``, ``first_token`` or ``names`` (the prompt's page names as
        prefill computed them; ``None``: named here) do not fit the request and the model.
        One request alone; ``start_decode`` / ``decode_step`` / ``finish_decode`` run
        several in one batch.
        """
        seq = self.start_decode(req, prompt_kv_pages, num_prompt_tokens, first_token, state,
                                names, l3_pages)
        try:
            while not seq.done:
                req.check_deadline("decode")
                self.decode_step([seq])
        finally:
            self.cores.idle()
        return self.finish_decode(seq)

    def start_decode(self, req: Req, prompt_kv_pages: torch.Tensor, num_prompt_tokens: int,
                     first_token: int, state: PromptState | None = None,
                     names: Sequence[bytes] | None = None,
                     l3_pages: int | None = None) -> DecodeSeq:
        """Check the handoff, copy the prompt's KV (and state) into private buffers, start
        offload under the prompt's page ``names`` (of which L3 holds the first
        ``l3_pages``, as prefill said; ``None``: unknown, offload asks). Pages lent by
        ``self.buffers`` (the tensor decode's cache joined for this request) go back to
        it once copied: the caller does not use them after."""
        self._check_request(req)
        if num_prompt_tokens != len(req.input_ids):
            raise ValueError(f"num_prompt_tokens: {num_prompt_tokens} != prompt length "
                             f"{len(req.input_ids)} of request {req.rid!r}")
        vocab = self.config.model.vocab_size
        if isinstance(first_token, bool) or not isinstance(first_token, int) \
                or not 0 <= first_token < vocab:
            raise ValueError(f"first_token: expected a token id in [0, {vocab}), got "
                             f"{first_token!r}")
        n, steps = num_prompt_tokens, req.max_new_tokens
        two, layers, _, heads, dim = self.layout.page_shape
        # NOTE: one buffer for the whole sequence, the prompt's KV copied straight from its
        # pages (checked there); the last token's KV is never needed. A page tensor decode
        # joined for this request alone (``self.buffers``') is handed back once copied.
        buf = self.buffers.take((two, layers, n + max(steps, 1) - 1, heads, dim),
                                self.device_pool.data)
        pages_to_kv(prompt_kv_pages, n, self.layout, out=buf)
        self.buffers.give(prompt_kv_pages)
        recurrent = self._recurrent(state)
        offloading = None
        if self.offload is not None:
            offloading = self.offload.offload_kv_cache(req, names,
                                                       state.pages if state else None,
                                                       l3_pages=l3_pages)
        tokens = [first_token] if steps else []
        seq = DecodeSeq(req, buf, n, tokens, list(req.input_ids) + tokens, offloading,
                        recurrent)
        if self.keeper is not None and state is not None:
            seq.kept_states = dict(state.pages)
        return seq

    def _recurrent(self, state: PromptState | None) -> torch.Tensor | None:
        """A private copy of a hybrid prompt's final state (``None`` for a plain model)."""
        if not self.layout.has_state:
            return None
        if state is None:
            raise ValueError("state: a hybrid model decodes from the prompt's KV and its "
                             "recurrent state; the handoff carries no state")
        check_model_state(state.final, self.config.model, field="state.final")
        return state.final.to(self.device_pool.device, copy=True)

    def decode_step(self, seqs: list[DecodeSeq]) -> None:
        """One token for every unfinished sequence of ``seqs``, in one batched forward."""
        live = [s for s in seqs if not s.done]
        if not live:
            return
        ended = [s.req.rid for s in live if s.ended]
        if ended:   # NOTE: their buffers may be another sequence's by now
            raise ValueError(f"decode_step: requests {ended} ended (stop_decode) already")
        states = [s.recurrent for s in live] if self.layout.has_state else None
        with self.cores.step():
            logits = self.model.decode_step([s.tokens[-1] for s in live],
                                            [s.buf for s in live], [s.pos for s in live],
                                            states)
        self.stats.count(DECODE, "step")
        self.stats.count(DECODE, "token", len(live))
        for seq, row in zip(live, logits):
            token = sample(row, seq.req.sampling, len(seq.tokens))
            seq.tokens.append(token)
            seq.seq.append(token)
            seq.pos += 1
            if self.keeper is not None and seq.recurrent is not None:
                self._checkpoint(seq)
            if seq.state is not None:
                self._offload(seq)

    def _checkpoint(self, seq: DecodeSeq) -> None:
        """Keep a hybrid sequence's state at a checkpoint page it just filled."""
        page, rest = divmod(seq.pos, self.page_size)
        if not rest and page % self.state_every == 0:
            seq.kept_states[page - 1] = seq.recurrent.clone()

    def _offload(self, seq: DecodeSeq) -> None:
        """Hand the offload manager the pages filled so far (a hybrid model's states at
        page ends kept until a write has taken them)."""
        if seq.recurrent is not None and seq.pos % self.page_size == 0:
            seq.page_states[seq.pos // self.page_size - 1] = seq.recurrent.clone()
        self.offload.advance(seq.state, seq.seq, seq.buf, seq.pos,
                             page_states=seq.page_states)
        if seq.page_states:
            written = seq.state.num_pages
            seq.page_states = {i: s for i, s in seq.page_states.items() if i >= written}

    def finish_decode(self, seq: DecodeSeq) -> list[int]:
        """Offload the last full pages; fills ``req.output_ids``; returns the tokens."""
        self.stop_decode(seq)
        seq.req.output_ids = list(seq.tokens)
        return list(seq.tokens)

    def stop_decode(self, seq: DecodeSeq) -> None:
        """The sequence ends (finished, or dropped: cancelled, past its deadline): offload
        what it has not written yet (the prompt's pages L3 lacks, the full pages since)."""
        if seq.state is not None:
            self.offload.advance(seq.state, seq.seq, seq.buf, seq.pos, final=True,
                                 page_states=seq.page_states)
            seq.state = None
        if self.keeper is not None and not seq.kept:
            seq.kept = True
            self._keep(seq)
        if not seq.ended:   # NOTE: offload and keep copied what they took of the buffer
            seq.ended = True
            self.buffers.give(seq.buf)

    def _keep(self, seq: DecodeSeq) -> None:
        """The sequence's full pages into decode's prefix cache (a fault there costs only
        the reuse, never the request)."""
        states = dict(seq.kept_states)
        if seq.recurrent is not None and seq.pos % self.page_size == 0:
            states[seq.pos // self.page_size - 1] = seq.recurrent
        try:
            self.keeper(seq.req, seq.seq, seq.buf, seq.pos, states)
        except Exception:  # noqa: BLE001
            log.exception("request %s: keeping its pages in decode's cache failed",
                          seq.req.rid)

