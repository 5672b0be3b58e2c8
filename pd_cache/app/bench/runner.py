"""The open loop: every request sent at its scheduled time, whatever came back before.

Request ``i`` is due at ``start + arrivals[i]``. It goes out then, unless the prompt embeds
the answer of an earlier request (a conversation's next turn) that has not finished: it then
goes out as soon as that answer is in (``sent_s`` > ``scheduled_s`` shows the wait), and
if that request failed, it fails too (``DependencyFailed``) without being sent. With
``max_concurrency`` at most that many are in flight; the rest wait their turn, and that wait
counts in their latency, as a client's would.

``lockstep`` adds a round barrier (a closed loop's rounds): a request of turn ``t > 0`` goes
out only once every request of turn ``t - 1`` in the stream has finished, so a round's
requests are in flight together and the next round starts after its last answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from pd_cache.app.bench.records import RequestRecord
from pd_cache.app.bench.targets import Reply, TargetError, Tokens


class RunOutput:
    """What one run produced: a record per request and the answers' token ids."""

    def __init__(self, records: list[RequestRecord], answers: dict[int, list[int]],
                 prompts: dict[int, list[int]], duration_s: float) -> None:
        self.records, self.answers, self.prompts = records, answers, prompts
        self.duration_s = duration_s


async def run_open_loop(target: Any, requests: Sequence[Any], arrivals: Sequence[float], *,
                        max_concurrency: int | None = None, lockstep: bool = False,
                        on_done: Callable[[RequestRecord], None] | None = None) -> RunOutput:
    """Send ``requests[i]`` at ``arrivals[i]`` seconds from now; every request's record.
    ``lockstep``: a turn's requests wait for every request of the turn before."""
    if len(arrivals) != len(requests):
        raise ValueError(f"arrivals: need one per request ({len(requests)}), "
                         f"got {len(arrivals)}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    finished = {r.index: asyncio.Event() for r in requests}
    rounds: dict[int, list[asyncio.Event]] = defaultdict(list)
    for r in requests:
        rounds[r.turn].append(finished[r.index])
    answers: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    start = time.perf_counter()

    async def one(spec: Any, due: float) -> RequestRecord:
        try:
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
            if lockstep:
                for event in rounds.get(spec.turn - 1, ()):
                    await event.wait()
            if spec.depends_on is not None:
                await finished[spec.depends_on].wait()
                if spec.depends_on not in answers:
                    return _failed(spec, due, time.perf_counter() - start, "DependencyFailed",
                                   f"request {spec.depends_on}, whose answer this prompt "
                                   f"carries, failed")
            prompt = spec.prompt_ids(answers)
            prompts[spec.index] = prompt
            if slots is None:
                record = await _send(target, spec, prompt, due, start, answers)
            else:
                async with slots:
                    record = await _send(target, spec, prompt, due, start, answers)
        except Exception as exc:  # noqa: BLE001 - every failure is a result, not a crash
            record = _failed(spec, due, time.perf_counter() - start, _kind(exc), str(exc))
        finally:
            finished[spec.index].set()
        if on_done is not None:
            on_done(record)
        return record

    records = await asyncio.gather(*(one(r, float(t)) for r, t in zip(requests, arrivals)))
    return RunOutput(list(records), answers, prompts, time.perf_counter() - start)


async def _send(target: Any, spec: Any, prompt: list[int], due: float, start: float,
                answers: dict[int, list[int]]) -> RequestRecord:
    sent = time.perf_counter()
    first: float | None = None
    last = sent
    itl: list[float] = []
    reply: Reply | None = None
    try:
        async for item in target.stream(spec, prompt):
            now = time.perf_counter()
            if isinstance(item, Reply):
                reply = item
            elif isinstance(item, Tokens):
                if first is None:
                    first = now
                else:
                    # NOTE: a chunk of n tokens is n gaps of equal share, as vllm counts it.
                    itl += [(now - last) * 1e3 / item.count] * item.count
                last = now
    except Exception as exc:  # noqa: BLE001
        return _failed(spec, due, sent - start, _kind(exc), str(exc), len(prompt))
    end = time.perf_counter()
    if reply is None:
        return _failed(spec, due, sent - start, "NoReply", "the stream ended without an answer",
                       len(prompt))
    answers[spec.index] = list(reply.output_ids)
    return RequestRecord(
        index=spec.index, rid=f"bench-{spec.index}", tenant=spec.tenant, session=spec.session,
        turn=spec.turn, scheduled_s=due, sent_s=sent - start,
        first_token_s=None if first is None else first - start, end_s=end - start,
        ttft_ms=None if first is None else (first - sent) * 1e3, itl_ms=itl,
        e2el_ms=(end - sent) * 1e3,
        prompt_tokens=reply.prompt_tokens if reply.prompt_tokens is not None else len(prompt),
        output_tokens=len(reply.output_ids), cached_tokens=reply.cached_tokens,
        expected_cached_tokens=None, tier_hits=reply.tier_hits,
        cross_namespace_tokens=reply.cross_namespace_tokens,
        prefill_worker=reply.prefill_worker, decode_worker=reply.decode_worker,
        attempts=reply.attempts, error=None, error_type=None)


def _failed(spec: Any, due: float, sent_s: float, kind: str, message: str,
            prompt_tokens: int = 0) -> RequestRecord:
    return RequestRecord(
        index=spec.index, rid=f"bench-{spec.index}", tenant=spec.tenant, session=spec.session,
        turn=spec.turn, scheduled_s=due, sent_s=sent_s, first_token_s=None, end_s=None,
        ttft_ms=None, itl_ms=[], e2el_ms=None, prompt_tokens=prompt_tokens, output_tokens=0,
        cached_tokens=None, expected_cached_tokens=None, tier_hits=None,
        cross_namespace_tokens=None, prefill_worker=None, decode_worker=None,
        error=f"{kind}: {message}", error_type=kind)


def _kind(exc: BaseException) -> str:
    return exc.kind if isinstance(exc, TargetError) else type(exc).__name__
