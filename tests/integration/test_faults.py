"""Crashes and deadlines on a real PD cluster: a worker process killed with SIGKILL in the
middle of a run, and requests that outlive their deadline.

Central checks: no output is wrong, nothing hangs, every request succeeds (the one a dead
worker held runs again elsewhere), the cluster reports healthy again once the actor has
restarted, and no slot or lock is left behind.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pd_cache import ClusterConfig, Completion, PDCluster, Req
from pd_cache.core.request import DeadlineExceeded, SamplingParams
from pd_cache.core.vocab import DEADLINE, DECODE
from pd_cache.model.model import Model, reference_generate
from tests.integration.clusters import (
    assert_idle,
    expected,
    started,
    stream_killing,
    stream_killing_decode,
    wait_healthy,
)

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(num_prefill=2, num_decode=2, num_storage=1, model="tiny", page_size=PS,
                       device_pages=64, host_pages=128, storage_timeout_s=5.0)
VOCAB = CONFIG.pd_config.model.vocab_size


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Iterator[PDCluster]:
    yield from started(CONFIG)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CONFIG.pd_config.model)


def workload(seed: int, n: int, max_new: int = 6) -> list[Req]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(24)]
    return [Req(rid=f"f{seed}-{i}", input_ids=system + [rng.randrange(VOCAB) for _ in range(9)],
                cache_salt=f"tenant-{i % 4}", max_new_tokens=max_new) for i in range(n)]


def run_and_kill(cluster: PDCluster, reqs: list[Req], role: str,
                 victim: int) -> tuple[list[Completion], int]:
    """Send every request at once; kill -9 ``victim`` once the first answer is back."""
    actor = getattr(cluster, role)[victim]
    pid = ray.get(actor.pid.remote())

    async def run() -> tuple[list[Completion], int]:
        tasks = [asyncio.ensure_future(cluster.generate_async(r)) for r in reqs]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        in_flight = sum(not t.done() for t in tasks)
        os.kill(pid, signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120)), in_flight

    outs, in_flight = asyncio.run(run())
    assert in_flight > 0
    return outs, pid


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_killed_mid_run_loses_no_request_and_comes_back(cluster: PDCluster,
                                                                 model: Model,
                                                                 role: str) -> None:
    reqs = workload(seed=1 if role == "prefill" else 2, n=48)
    outs, pid = run_and_kill(cluster, reqs, role, victim=0)
    for out, r in zip(outs, reqs):
        assert out.output_ids == expected(model, r), r.rid
        assert out.cross_namespace_tokens == 0
    retried = [o for o in outs if o.attempts == 2]
    assert retried, "no request was in flight on the killed worker"
    wait_healthy(cluster, role, worker=0)
    assert ray.get(getattr(cluster, role)[0].pid.remote()) != pid   # a new process
    after = workload(seed=3 if role == "prefill" else 4, n=8)
    for out, r in zip(cluster.generate_many(after), after):
        assert out.output_ids == expected(model, r) and out.attempts == 1
    used = {getattr(cluster.generate(r, **{f"{role}_worker": 0}), f"{role}_worker")
            for r in workload(seed=5, n=1)}
    assert used == {0}                                                  # it serves again
    cluster.flush()
    assert_idle(cluster)


def test_requests_past_their_deadline_stop_costing_work(cluster: PDCluster,
                                                        model: Model) -> None:
    before = cluster.engine_stats()
    rng = random.Random(7)
    long = [Req(rid=f"long-{i}", input_ids=[rng.randrange(VOCAB) for _ in range(16)],
                max_new_tokens=400, deadline=time.time() + 0.5) for i in range(24)]
    results = cluster.generate_many(long, return_exceptions=True)
    assert all(isinstance(r, DeadlineExceeded) for r in results), results
    after = cluster.engine_stats()

    def total(stats: dict[str, dict[str, int]], key: str) -> int:
        return sum(s.get(key, 0) for s in stats.values())
    drawn = total(after, f"{DECODE}/token") - total(before, f"{DECODE}/token")
    # 24 x 400 tokens were asked for; what ran before the deadline is a small part of it.
    assert drawn < 0.25 * 24 * 400, drawn
    assert total(after, f"{DEADLINE}/dropped") - total(before, f"{DEADLINE}/dropped") > 0
    ok = Req(rid="after-deadlines", input_ids=long[0].input_ids, max_new_tokens=4,
             deadline=time.time() + 30)
    assert cluster.generate(ok).output_ids == expected(model, ok)
    assert_idle(cluster)


def first_turn(cluster: PDCluster, seed: int, tag: str, salt: str) -> tuple[Req, Completion]:
    """A conversation's first turn (26 tokens, 7 drawn), served."""
    rng = random.Random(seed)
    turn1 = Req(rid=f"{tag}-1", input_ids=[rng.randrange(VOCAB) for _ in range(26)],
                cache_salt=salt, max_new_tokens=7)
    return turn1, cluster.generate(turn1)


def next_turn(prev: Req, out: Completion, more: list[int], max_new: int) -> Req:
    """The turn after ``prev``: its prompt, its answer ``out`` and ``more`` tokens."""
    tag, n = prev.rid.rsplit("-", 1)
    return Req(rid=f"{tag}-{int(n) + 1}", input_ids=prev.input_ids + out.output_ids + more,
               cache_salt=prev.cache_salt, max_new_tokens=max_new)


def check_kept_again(cluster: PDCluster, model: Model, prev: Req, out: Completion) -> Completion:
    """The turn after ``prev`` (answered ``out``) is correct and finds all of ``prev``'s
    pages but the last drawn token's kept on decode."""
    turn = next_turn(prev, out, [8, 9], 4)
    got = cluster.generate(turn)
    assert got.output_ids == expected(model, turn)
    assert got.pages_kept == (len(prev.input_ids) + len(out.output_ids) - 1) // PS
    return got


def test_a_conversation_whose_decode_worker_is_killed_goes_on_correctly(
        cluster: PDCluster, model: Model) -> None:
    """kill -9 of the decode worker that keeps a conversation's pages, between its turns:
    the next turn is the model's own answer (a full handoff elsewhere or to the restarted,
    cold worker), and the turn after it is kept again."""
    turn1, out1 = first_turn(cluster, 21, "conv", "tenant-k")
    victim = out1.decode_worker
    pid = ray.get(cluster.decode[victim].pid.remote())
    os.kill(pid, signal.SIGKILL)
    turn2 = next_turn(turn1, out1, [5, 6, 7], 6)
    out2 = cluster.generate(turn2)
    assert out2.output_ids == expected(model, turn2) and out2.pages_kept == 0
    check_kept_again(cluster, model, turn2, out2)
    wait_healthy(cluster, "decode", worker=victim)
    assert ray.get(cluster.decode[victim].pid.remote()) != pid
    cluster.flush()
    assert_idle(cluster)


def test_a_decode_worker_killed_between_its_reservation_and_the_handoff(
        cluster: PDCluster, model: Model) -> None:
    """kill -9 of the decode worker holding a conversation, once it has answered the next
    turn's reservation and before the handoff reaches it: the turn is the model's own answer
    (run again elsewhere, or refilled by the restarted, cold worker), the worker comes back,
    the next turn is kept again, and no worker holds a lock or a request's slot."""
    turn1, out1 = first_turn(cluster, 23, "resv", "tenant-r")
    victim = out1.decode_worker
    pid = ray.get(cluster.decode[victim].pid.remote())
    turn2 = next_turn(turn1, out1, [5, 6, 7], 6)
    prefill, answered = cluster._prefill, []

    async def kill_once_reserved(req: Req, names: Any, pinned: Any, failed: Any = (),
                                 reserved: Any = None, **route: Any) -> Any:
        if reserved.worker == victim and not answered:
            answered.append(await reserved.call)
            os.kill(pid, signal.SIGKILL)
        return await prefill(req, names, pinned, failed, reserved, **route)
    cluster._prefill = kill_once_reserved   # type: ignore[method-assign]
    try:
        out2 = cluster.generate(turn2)
    finally:
        del cluster._prefill
    assert answered == [(26 + 7 - 1) // PS]
    assert out2.output_ids == expected(model, turn2)
    wait_healthy(cluster, "decode", worker=victim)
    assert ray.get(cluster.decode[victim].pid.remote()) != pid
    if out2.attempts == 2:   # the decode call failed: prefill again, a full handoff
        assert out2.decode_worker != victim and out2.pages_kept == 0
    else:                    # Ray held the call for the restarted worker: it refilled
        stats = cluster.engine_stats()[f"decode-{victim}"]
        assert out2.decode_worker == victim and stats["keep/lost"] == 1, stats
    out3 = check_kept_again(cluster, model, turn2, out2)
    assert out3.decode_worker == out2.decode_worker
    cluster.flush()
    assert_idle(cluster)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)],
                         ids=["greedy", "sampled"])
def test_a_stream_whose_decode_worker_is_killed_resumes_elsewhere(
        cluster: PDCluster, model: Model, sampling: SamplingParams) -> None:
    """kill -9 of the decode worker a stream is on, after its 6th token: the stream goes on
    from another worker and the client gets the answer an unbroken run gives (every token
    once, in order; with sampling, the same draws), reported as a second attempt; the
    worker comes back."""
    rng = random.Random(9)
    r = Req(rid="long-stream", input_ids=[rng.randrange(VOCAB) for _ in range(37)],
            cache_salt="tenant-s", max_new_tokens=400, sampling=sampling)
    want = reference_generate(model, Req(rid="ref", input_ids=r.input_ids,
                                         max_new_tokens=400, sampling=sampling)).output_ids
    tokens, out, worker, pid = stream_killing_decode(cluster, r)
    assert tokens == want and out.output_ids == want     # nothing lost, nothing twice
    assert out.attempts == 2 and out.num_prompt_tokens == 37
    assert out.decode_worker != worker
    wait_healthy(cluster, "decode", worker=worker)
    assert ray.get(cluster.decode[worker].pid.remote()) != pid
    cluster.flush()
    assert_idle(cluster)


HOLD = ClusterConfig(num_prefill=2, num_decode=1, num_storage=0, model="tiny", page_size=PS,
                     device_pages=64, host_pages=128, prefill_hold_s=1.0)


@pytest.fixture
def holding(ray_cluster: Any) -> Iterator[PDCluster]:
    """A cluster whose prefill workers wait 1 s between their answer and the KV: the window
    a test kills one in."""
    yield from started(HOLD)


def test_a_prefill_worker_killed_after_its_answer_before_its_kv_resumes_the_stream(
        holding: PDCluster, model: Model) -> None:
    """kill -9 of the prefill worker a conversation's next turn is on, once the first token
    is in and before the worker stored the KV for decode: the stream goes on from the other
    worker (prompt + the token sent), every token once, the answer the no-cache model's,
    reported as a second attempt; decode's reservation of the turn's kept pages released,
    and no lock or slot left anywhere once the worker is back."""
    turn1, out1 = first_turn(holding, 25, "held", "tenant-h")
    turn2 = next_turn(turn1, out1, [5, 6, 7], 6)
    names = holding.router_names(turn2)
    pids = ray.get([a.pid.remote() for a in holding.prefill])
    reserved = holding.engine_stats()["decode-0"].get("keep/reserved", 0)

    def answered() -> tuple[int, int]:   # the first token: its worker holds the KV 1 s more
        worker = max(range(2), key=lambda w: holding.prefill_router.matched(w, names))
        return worker, pids[worker]
    tokens, out, victim, pid = stream_killing(holding, turn2, 1, answered)
    want = expected(model, turn2)
    assert tokens == want and out.output_ids == want     # nothing lost, nothing twice
    assert out.attempts == 2 and out.prefill_worker == victim
    wait_healthy(holding, "prefill", worker=victim)      # engine_stats asks every worker
    stats = holding.engine_stats()["decode-0"]
    assert stats.get("keep/reserved", 0) > reserved      # the turn's pages were reserved
    assert ray.get(holding.prefill[victim].pid.remote()) != pid
    holding.flush()
    assert_idle(holding)
    assert all(not s.requests for s in holding.states())
    assert holding.turns.held == 0 and holding.prefill_router.loads == [0, 0]
    assert holding.decode_router.loads == [0]
