"""What the cluster test modules share: prompts, requests, the no-cache answer, a chat
through ``pd-cache bench``'s closed loop, and the check that a cluster is idle between
scenarios (no lock held, every slot the cache's)."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

from pd_cache.app.bench.runner import RunOutput, run_open_loop
from pd_cache.app.bench.targets import LocalTarget
from pd_cache.app.bench.workloads import Workload
from pd_cache.core.request import Req
from pd_cache.core.wire import Completion
from pd_cache.model.model import Model, reference_generate
from pd_cache.worker.ledger import held

_ids = itertools.count()


def started(config: Any) -> Iterator[Any]:
    """A module's cluster (``yield from`` in its fixture): started on the session's Ray,
    shut down at the end checking that no worker leaked a lock or a slot."""
    from pd_cache import PDCluster

    c = PDCluster.start(config)
    yield c
    c.shutdown(check=True)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def request(ids: list[int], ns: tuple[str | None, str | None] = (None, None),
            max_new: int = 5, prefix: str = "r") -> Req:
    """A request with a rid of its own, in namespace ``ns`` (``extra_key``, ``cache_salt``)."""
    return Req(rid=f"{prefix}{next(_ids)}", input_ids=ids, extra_key=ns[0], cache_salt=ns[1],
               max_new_tokens=max_new)


def expected(model: Model, r: Req) -> list[int]:
    """The answer to ``r``'s prompt with no cache at all (namespace left out)."""
    return reference_generate(model, Req(rid="ref", input_ids=r.input_ids,
                                         max_new_tokens=r.max_new_tokens,
                                         sampling=r.sampling)).output_ids


def closed_loop(cluster: Any, workload: Workload, *, lockstep: bool) -> RunOutput:
    """``workload`` through ``pd-cache bench``'s closed loop on ``cluster`` (every request due
    at once: a turn goes when its user's answer is in; ``lockstep``: once its round's is)."""
    arrivals = [0.0] * len(workload.requests)
    return asyncio.run(asyncio.wait_for(run_open_loop(LocalTarget(cluster), workload.requests,
                                                      arrivals, lockstep=lockstep), 300))


def check_answers(model: Model, workload: Workload, run: RunOutput) -> None:
    """Every request answered, the prompt the bench sent built from the answers before it,
    and each answer the no-cache model's own; no cross-namespace hit."""
    assert [r.error for r in run.records if not r.ok] == []
    for spec in workload.requests:
        prompt = run.prompts[spec.index]
        assert prompt == spec.prompt_ids(run.answers)
        ref = Req(rid="ref", input_ids=prompt, max_new_tokens=spec.max_tokens)
        assert run.answers[spec.index] == expected(model, ref), spec.index
    assert all(r.cross_namespace_tokens == 0 for r in run.records)


def assert_idle(cluster: Any, pools: Collection[str] = ()) -> None:
    """No worker holds a lock, every slot belongs to the cache, no live worker holds a core
    in its node's ledger; ``pools`` must be reported (a hybrid model's ``state``)."""
    for state in cluster.states():
        assert state.locks == 0, state
        assert set(pools) <= set(state.pool_usage), state
        owners = {o for pool in state.pool_usage.values() for o in pool}
        assert owners <= {"radix"}, state   # every request's own slots were released
    assert_cores_idle()


def assert_cores_idle(timeout_s: float = 5.0) -> None:
    """Every forward gave back the cores it took and every decode worker whose batch
    emptied is idle (``worker.cores``; a killed worker's slot does not count). A decode
    worker marks itself idle just after its last answer is sent: a short wait for it."""
    deadline = time.monotonic() + timeout_s
    while any(busy := {n: h for n, h in held().items() if h}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not busy, f"cores still held by idle workers: {busy}"


def stream_killing_decode(cluster: Any, req: Req, after: int = 6
                          ) -> tuple[list[int], Completion, int, int]:
    """Stream ``req``; once ``after`` tokens are in, kill -9 the decode worker it is on (the
    only one with a request in flight). Returns the tokens received, the completion, and
    the victim's index and pid."""
    import ray

    def victim() -> tuple[int, int]:
        worker = cluster.decode_router.loads.index(1)
        return worker, ray.get(cluster.decode[worker].pid.remote())
    return stream_killing(cluster, req, after, victim)


def stream_killing(cluster: Any, req: Req, after: int, victim: Callable[[], tuple[int, int]]
                   ) -> tuple[list[int], Completion, int, int]:
    """Stream ``req``; once ``after`` tokens are in, kill -9 the worker ``victim()`` names
    (its index and pid). Returns the tokens received, the completion, and the victim."""
    killed: list[int] = []

    async def consume() -> tuple[list[int], Completion]:
        tokens: list[int] = []
        async for item in cluster.stream(req):
            if isinstance(item, Completion):
                return tokens, item
            tokens.append(item)
            if len(tokens) == after:
                killed.extend(victim())
                os.kill(killed[1], signal.SIGKILL)
        raise AssertionError("the stream ended without a completion")

    tokens, out = asyncio.run(asyncio.wait_for(consume(), 120))
    return tokens, out, killed[0], killed[1]


def until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """A bounded poll: until ``check()`` holds (``what`` says what did not, on timeout)."""
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.1)


def alive(handle: Any) -> bool:
    """Whether ``handle``'s actor answers ``ping`` (an L3 shard's) within 10 s."""
    import ray

    try:
        ray.get(handle.ping.remote(), timeout=10)
        return True
    except ray.exceptions.RayError:
        return False


def killed(handle: Any, timeout_s: float = 30) -> None:
    """``ray.kill(handle, no_restart=True)``, back once the actor answers no more: the kill
    takes effect after ``ray.kill`` returns, and a call sent meanwhile may still be
    answered."""
    import ray

    ray.kill(handle, no_restart=True)
    until(lambda: not alive(handle), "the killed actor still answers", timeout_s)


def l3_records(cluster: Any) -> list[int]:
    """The records each L3 shard of ``cluster`` holds."""
    import ray

    return [u.records for u in ray.get([s.usage.remote() for s in cluster.storage])]


def wait_healthy(cluster: Any, role: str, worker: int, timeout_s: float = 45) -> None:
    """A bounded poll: until ``worker`` of ``role`` answers again."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = asyncio.run(cluster.health(timeout_s=2.0))
        if worker in state["live"][role]:
            assert state["healthy"]
            return
        time.sleep(0.2)
    raise AssertionError(f"{role} worker {worker} never answered again: {state}")
