"""``DecodeBatcher``: continuous batching of decode steps on one engine.

Callers (a decode actor's request threads) hand in a request and block; one thread owns
the engine and, step after step, runs every request in flight in one batched forward.
A request joins at the next step after it arrives and leaves as soon as it has its
tokens, so a long answer never holds a short one back::

    step    1    2    3    4    5    6
    req a   a1   a2   a3   a4                 (done: its caller wakes up)
    req b        b1   b2   b3   b4   b5
    req c                  c1   c2   c3 ...

Every engine call (``start_decode``, ``decode_step``, ``finish_decode``) runs on that one
thread, so the engine stays single-threaded. A bad request fails alone: its caller gets
the ``ValueError``, the others keep going. A request past its deadline is never started,
and one that expires while decoding leaves the batch at the next step (its caller gets
``DeadlineExceeded``; its KV buffer goes with it). A caller may watch its tokens as they
are drawn (``on_token``, called on the engine's thread) and ``cancel`` its request (a
client that went away): it leaves the batch at the next step.

With ``metrics``, the thread records how long each request waited for a place in the batch
(queue time) and the time between its consecutive tokens (inter-token latency; the first
is measured from when it joined, since the first token came from prefill).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import NamedTuple

import torch

from pd_cache.core.request import DeadlineExceeded, Req
from pd_cache.core.vocab import DEADLINE
from pd_cache.metrics import PDCacheMetrics
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.outputs import DecodeSeq, PromptState


class _Job(NamedTuple):
    req: Req
    pages: torch.Tensor
    num_prompt_tokens: int
    first_token: int
    done: Future[list[int]]
    on_token: Callable[[int], None] | None = None
    submitted: float = 0.0   # time.perf_counter() when handed in
    state: PromptState | None = None   # a hybrid prompt's recurrent state
    names: Sequence[bytes] | None = None   # the prompt's page names, as prefill computed them
    l3_pages: int | None = None   # the prompt's leading pages L3 holds (None: unknown)


log = logging.getLogger(__name__)

Active = list[tuple[DecodeSeq, _Job]]


class DecodeBatcher:
    """Decodes the requests handed to ``decode`` from any thread, up to ``max_batch`` per
    forward; the rest wait their turn in arrival order."""

    def __init__(self, engine: LocalEngine, *, max_batch: int = 8,
                 metrics: PDCacheMetrics | None = None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected an int >= 1, got {max_batch!r}")
        self.engine, self.max_batch, self.metrics = engine, max_batch, metrics
        self._last_token: dict[int, float] = {}   # id(seq) -> when it last got a token
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._live: set[str] = set()        # rids handed in and not settled yet
        self._cancelled: set[str] = set()   # a subset of them
        self._thread = threading.Thread(target=self._loop, name="pd-cache-decode",
                                        daemon=True)
        self._closed = False
        self._thread.start()

    def decode(self, req: Req, pages: torch.Tensor, num_prompt_tokens: int,
               first_token: int, state: PromptState | None = None,
               names: Sequence[bytes] | None = None) -> list[int]:
        """Like ``LocalEngine.decode`` (same checks, same tokens), batched with the other
        requests in flight; blocks until this one is done."""
        return self.submit(req, pages, num_prompt_tokens, first_token, state=state,
                           names=names).result()

    def submit(self, req: Req, pages: torch.Tensor, num_prompt_tokens: int,
               first_token: int, on_token: Callable[[int], None] | None = None, *,
               state: PromptState | None = None, names: Sequence[bytes] | None = None,
               l3_pages: int | None = None) -> Future[list[int]]:
        """Hand a request in (with a hybrid prompt's ``state``, the prompt's page ``names``
        and ``l3_pages`` as ``LocalEngine.decode`` takes them); ``on_token(t)`` sees each
        token after the first as it is drawn. The future holds every token, or the error
        that ended the request."""
        if self._closed:
            raise RuntimeError("DecodeBatcher: closed")
        done: Future[list[int]] = Future()
        self._live.add(req.rid)
        done.add_done_callback(lambda _: self._forget(req.rid))   # however it ends
        self._queue.put(_Job(req, pages, num_prompt_tokens, first_token, done, on_token,
                             time.perf_counter(), state, names, l3_pages))
        return done

    def cancel(self, rid: str) -> None:
        """Drop request ``rid`` at the next step (its future gets ``CancelledError``); a rid
        that is not in flight (finished, or never handed in) is ignored."""
        if rid in self._live:
            self._cancelled.add(rid)

    def in_flight(self) -> tuple[str, ...]:
        """The rids handed in and not settled yet (in the batch or waiting for a place)."""
        return tuple(sorted(self._live.copy()))   # NOTE: copy() is atomic; other threads add

    def _forget(self, rid: str) -> None:
        self._live.discard(rid)
        self._cancelled.discard(rid)

    def close(self) -> None:
        """Finish the requests already handed in, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()

    # -- the engine's thread ---------------------------------------------------------------

    def _loop(self) -> None:
        active: Active = []
        stopping = False
        while active or not stopping:
            if not active:
                self.engine.cores.idle()   # its core is lent again until a job comes
            stopping = self._start_waiting(active, block=not active) or stopping
            if not active:
                continue
            try:
                self.engine.decode_step([seq for seq, _ in active])
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                for _, job in active:
                    job.done.set_exception(e)
                active.clear()
                continue
            self._timed_step(active)
            for seq, job in active:
                if job.on_token is not None:
                    job.on_token(seq.tokens[-1])
            active[:] = [(s, j) for s, j in active if not self._finish(s, j) and not
                         self._dropped(j, s)]
            self._last_token = {id(s): self._last_token[id(s)] for s, _ in active
                                if id(s) in self._last_token}
        while not self._queue.empty():   # handed in after close: never started
            job = self._queue.get()
            if job is not None:
                job.done.set_exception(RuntimeError("DecodeBatcher: closed"))

    def _start_waiting(self, active: Active, *, block: bool) -> bool:
        """Start the jobs waiting, up to the batch size; ``True`` once ``close`` was seen."""
        while len(active) < self.max_batch:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return False
            if job is None:
                return True
            block = False
            if self._dropped(job):
                continue
            try:
                seq = self.engine.start_decode(job.req, job.pages, job.num_prompt_tokens,
                                               job.first_token, job.state, job.names,
                                               job.l3_pages)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                job.done.set_exception(e)
                continue
            if self.metrics is not None:
                now = time.perf_counter()
                self.metrics.observe_queue(now - job.submitted, "decode")
                self._last_token[id(seq)] = now
            if not self._finish(seq, job):
                active.append((seq, job))
        return False

    def _timed_step(self, active: Active) -> None:
        """Record each request's time since its previous token (all got one this step)."""
        if self.metrics is None:
            return
        now = time.perf_counter()
        for seq, _ in active:
            self.metrics.observe_inter_token(now - self._last_token.get(id(seq), now), "decode")
            self._last_token[id(seq)] = now

    def _dropped(self, job: _Job, seq: DecodeSeq | None = None) -> bool:
        """Drop a request past its deadline (``DeadlineExceeded``) or cancelled; a
        sequence already started still offloads what it computed."""
        rid = job.req.rid
        if rid in self._cancelled:
            self.engine.stats.count(DEADLINE, "cancelled")
            error: Exception = CancelledError(f"request {rid}: cancelled")
        else:
            try:
                job.req.check_deadline("decode")
                return False
            except DeadlineExceeded as e:
                self.engine.stats.count(DEADLINE, "dropped")
                error = e
        if seq is not None:
            try:
                self.engine.stop_decode(seq)
            except Exception:  # noqa: BLE001 - an offload fault never outlives the request
                log.exception("request %s: offload at drop failed", rid)
        job.done.set_exception(error)
        return True

    def _finish(self, seq: DecodeSeq, job: _Job) -> bool:
        if not seq.done:
            return False
        try:
            job.done.set_result(self.engine.finish_decode(seq))
        except Exception as e:  # noqa: BLE001
            job.done.set_exception(e)
        return True
