"""The runner's closed loop on a fake target (pure logic, no cluster): a turn leaves when
its own answer is in, and with ``lockstep`` only once its whole round's answers are."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pd_cache.app.bench.driver import RoundLines
from pd_cache.app.bench.records import RequestRecord
from pd_cache.app.bench.runner import RunOutput, run_open_loop
from pd_cache.app.bench.targets import Reply, Tokens
from pd_cache.app.bench.workloads import Workload, multi_turn_workload


class SlowFirstUser:
    """Answers after a delay: user ``t0u0`` takes 0.3 s a turn, everyone else 0.01 s."""

    async def stream(self, spec: Any, prompt_ids: list[int]) -> AsyncIterator[Tokens | Reply]:
        await asyncio.sleep(0.3 if spec.session == "t0u0" else 0.01)
        yield Tokens(spec.max_tokens)
        yield Reply([spec.index] * spec.max_tokens, len(prompt_ids), 0)


def chat() -> Workload:
    return multi_turn_workload(1, 3, 3, system_tokens=4, user_tokens=2, output_tokens=2,
                               vocab_size=50, seed=1)


def closed_loop(lockstep: bool) -> RunOutput:
    w = chat()
    return asyncio.run(run_open_loop(SlowFirstUser(), w.requests, [0.0] * len(w.requests),
                                     lockstep=lockstep))


def round_gaps(run: RunOutput) -> list[float]:
    """Per round after the first: its first send minus the round before's last answer."""
    recs = run.records
    return [min(r.sent_s for r in recs if r.turn == t)
            - max(r.end_s for r in recs if r.turn == t - 1) for t in (1, 2)]


def test_lockstep_sends_no_request_of_a_round_before_the_last_answer_of_the_one_before() -> None:
    run = closed_loop(lockstep=True)
    assert all(r.ok for r in run.records)
    assert min(round_gaps(run)) >= 0
    # and a round is in flight together: all of its requests leave within a moment
    for t in range(3):
        sent = [r.sent_s for r in run.records if r.turn == t]
        assert max(sent) - min(sent) < 0.1


def test_without_lockstep_each_client_goes_at_its_own_pace() -> None:
    run = closed_loop(lockstep=False)
    recs = {r.index: r for r in run.records}
    w = chat()
    for spec in w.requests:   # each turn still waits for its own answer, embedded in it
        if spec.depends_on is not None:
            assert recs[spec.index].sent_s >= recs[spec.depends_on].end_s
            assert run.prompts[spec.index] == spec.prompt_ids(run.answers)
    # the fast users' later turns leave while the slow user's first turn is still out
    assert max(round_gaps(run)) < -0.1


def test_round_lines_print_each_round_as_its_last_answer_comes_in(
        capsys: pytest.CaptureFixture[str]) -> None:
    w = chat()
    lines = RoundLines(w.requests)
    for spec in w.requests:
        lines.finished(RequestRecord(index=spec.index, rid="r", tenant=0, session=spec.session,
                                     turn=spec.turn, scheduled_s=0.0, sent_s=spec.turn * 1.0,
                                     end_s=spec.turn + 0.5, prompt_tokens=10,
                                     cached_tokens=spec.turn * 4))
    assert capsys.readouterr().out.splitlines() == [
        "round 1/3: 3 requests in 0.50 s, 0/30 prompt tokens cached",
        "round 2/3: 3 requests in 0.50 s, 12/30 prompt tokens cached",
        "round 3/3: 3 requests in 0.50 s, 24/30 prompt tokens cached"]
