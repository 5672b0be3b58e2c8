"""The PD cluster on the session's Ray cluster: 2 prefill, 2 decode, 2 storage actors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from pd_cache.app.bench.workloads import Workload, multi_turn_workload
from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req
from pd_cache.core.wire import Completion
from pd_cache.model.model import Model
from pd_cache.worker.cores import LEND_MIN_TOKENS, node_cores
from tests.integration import clusters
from tests.integration.clusters import (
    assert_idle,
    check_answers,
    closed_loop,
    expected,
    request,
)

ray = pytest.importorskip("ray")

PS = 4
CONFIG = ClusterConfig(model="tiny", page_size=PS, device_pages=64, host_pages=128,
                       storage_timeout_s=5.0)
VOCAB = CONFIG.pd_config.model.vocab_size
NAMESPACES = [(None, None), (None, "tenant-a"), ("lora-1", None), ("lora-1", "tenant-a")]


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Iterator[PDCluster]:
    c = PDCluster.start(CONFIG)
    yield c
    c.shutdown(check=True)  # raises if any worker leaked a lock or a slot


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(CONFIG.pd_config.model)


def req(ids: list[int], ns: tuple[str | None, str | None] = (None, None),
        max_new: int = 5) -> Req:
    return request(ids, ns, max_new)


def tokens(seed: int, n: int) -> list[int]:
    return clusters.tokens(seed, n, VOCAB)


def chat(tenants: int, users: int, system: int, user: int, output: int, seed: int,
         preamble: int = 0) -> Workload:
    return multi_turn_workload(tenants, users, 3, system_tokens=system, user_tokens=user,
                               output_tokens=output, vocab_size=VOCAB, seed=seed,
                               preamble_tokens=preamble)


def test_multi_turn_multi_tenant_in_lockstep_equals_reference(cluster: PDCluster,
                                                              model: Model) -> None:
    """``pd-cache run``'s shape (the bench's closed loop with ``lockstep``, a preamble every
    tenant shares): every answer is the model's own, and no request of round r + 1 leaves
    before the last answer of round r is in."""
    wl = chat(3, 2, system=22, user=7, output=6, seed=11, preamble=8)
    run = closed_loop(cluster, wl, lockstep=True)
    check_answers(model, wl, run)
    recs = run.records
    for turn in (1, 2):
        last_answer = max(r.end_s for r in recs if r.turn == turn - 1)
        assert min(r.sent_s for r in recs if r.turn == turn) >= last_answer, turn
    assert sum(r.cached_tokens for r in recs) > 0  # the cache was used
    assert {r.prefill_worker for r in recs} == {0, 1} and {r.decode_worker for r in recs} == {0, 1}
    assert_idle(cluster)


def test_turn_two_on_other_worker_reads_turn_one_from_l3(cluster: PDCluster,
                                                         model: Model) -> None:
    ns = ("lora-7", "tenant-turns")
    turn1 = req(tokens(1, 21), ns, max_new=10)
    out1 = cluster.generate(turn1, prefill_worker=0)
    cluster.flush()
    turn2 = req(turn1.input_ids + out1.output_ids + tokens(2, 6), ns, max_new=4)
    out2 = cluster.generate(turn2, prefill_worker=1)
    assert out2.output_ids == expected(model, turn2)
    # Every page whose tokens all have KV after turn 1: the prompt's (prefill's write-through)
    # and the answer's (decode's offload; the last drawn token has no KV yet).
    assert out2.cached_tokens["storage"] == PS * ((21 + 10 - 1) // PS) > PS * (21 // PS)
    assert out2.cached_tokens["device"] == out2.cached_tokens["host"] == 0


def test_a_conversation_hands_decode_only_the_pages_it_lacks(cluster: PDCluster,
                                                             model: Model) -> None:
    """Decode's prefix cache: turn 2 goes back to turn 1's decode worker, which kept turn 1's
    prompt and answer; prefill hands over only the pages after them (turn 3 streamed)."""
    ns = ("lora-9", "tenant-keep")
    turn1 = req(tokens(31, 23), ns, max_new=9)
    out1 = cluster.generate(turn1)
    assert out1.pages_kept == 0 and out1.pages_handed_off == -(-23 // PS)
    turn2 = req(turn1.input_ids + out1.output_ids + tokens(32, 6), ns, max_new=5)
    out2 = cluster.generate(turn2)
    held = (23 + 9 - 1) // PS   # every page whose tokens all have KV on decode
    assert out2.output_ids == expected(model, turn2)
    assert out2.decode_worker == out1.decode_worker and out2.pages_kept == held
    assert out2.pages_handed_off == -(-(23 + 9 + 6) // PS) - held
    turn3 = req(turn2.input_ids + out2.output_ids + tokens(33, 5), ns, max_new=4)

    async def stream() -> Completion:
        async for item in cluster.stream(turn3):
            if isinstance(item, Completion):
                return item
        raise AssertionError("no completion")
    out3 = asyncio.run(stream())
    assert out3.output_ids == expected(model, turn3)
    assert out3.pages_kept == (len(turn2.input_ids) + 5 - 1) // PS
    stats = cluster.engine_stats()[f"decode-{out1.decode_worker}"]
    assert stats["keep/kept"] >= held + out3.pages_kept and "keep/lost" not in stats
    assert_idle(cluster)


def test_identical_prompts_share_pages_only_within_a_namespace(cluster: PDCluster) -> None:
    prompt = tokens(3, 18)
    a, b = ("lora-iso", "tenant-1"), (None, "tenant-1")
    cluster.generate(req(prompt, a), prefill_worker=0)
    cluster.flush()
    other = cluster.generate(req(prompt, b), prefill_worker=0)   # same worker, same tokens
    assert sum(other.cached_tokens.values()) == 0
    cluster.flush()
    same_local = cluster.generate(req(prompt, a), prefill_worker=0)
    same_l3 = cluster.generate(req(prompt, a), prefill_worker=1)
    assert same_local.cached_tokens["device"] == PS * 4
    assert same_l3.cached_tokens["storage"] == PS * 4
    names_a, names_b = cluster.router_names(req(prompt, a)), cluster.router_names(req(prompt, b))
    assert set(names_a).isdisjoint(names_b)
    assert cluster.l3_holds(names_a) == cluster.l3_holds(names_b) == 4   # two sets at L3
    assert all(c.cross_namespace_tokens == 0 for c in (other, same_local, same_l3))


@pytest.mark.parametrize("ns", NAMESPACES)
def test_page_names_agree_across_processes(cluster: PDCluster, ns: Any) -> None:
    r = req(tokens(4, 14), ns)
    names = cluster.page_names(r)
    assert len(names.router) == 3
    for computed in names.prefill + names.decode + names.storage:
        assert computed == names.router
    cluster.generate(r)
    cluster.flush()
    assert cluster.l3_holds(names.router) == 3   # stored under them
    others = [cluster.router_names(req(r.input_ids, o)) for o in NAMESPACES if o != ns]
    assert all(set(names.router).isdisjoint(o) for o in others)


def test_storage_actor_killed_mid_run_then_serving_resumes(cluster: PDCluster,
                                                            model: Model) -> None:
    reqs = [req(tokens(100 + i, 30 + i), (None, f"fault-{i % 3}"), max_new=8)
            for i in range(10)]

    in_flight = []

    async def run_and_kill() -> list[Completion]:
        tasks = [asyncio.ensure_future(cluster.generate_async(r)) for r in reqs]
        await asyncio.sleep(0.05)
        in_flight.append(sum(not t.done() for t in tasks))
        ray.kill(cluster.storage[0], no_restart=False)
        return await asyncio.gather(*tasks)

    pid_before = ray.get(cluster.storage[0].ping.remote())
    for out, r in zip(asyncio.run(run_and_kill()), reqs):
        assert out.output_ids == expected(model, r)
    assert in_flight[0] > 0  # the shard died under running requests
    pid_after = ray.get(cluster.storage[0].ping.remote(), timeout=60)  # restarted
    assert pid_after != pid_before
    cluster.flush()
    again = req(tokens(200, 26), ("lora-after", None), max_new=6)
    first = cluster.generate(again, prefill_worker=0)
    cluster.flush()
    second = cluster.generate(req(again.input_ids, again.namespace, 6), prefill_worker=1)
    assert first.output_ids == second.output_ids == expected(model, again)
    assert second.cached_tokens["storage"] == PS * 6  # L3 serves again, both shards
    assert_idle(cluster)


def test_bad_requests_fail_alone(cluster: PDCluster, model: Model) -> None:
    good = [req(tokens(300 + i, 12), (None, "bad-batch")) for i in range(2)]
    bad = [{"rid": "empty", "input_ids": []},
           {"rid": "range", "input_ids": [1, 2, VOCAB]},
           {"rid": "ns", "input_ids": [1, 2, 3], "cache_salt": ""},
           {"rid": "ns2", "input_ids": [1, 2, 3], "extra_key": 7}]
    outs = cluster.generate_many([good[0], *bad, good[1]], return_exceptions=True)
    messages = [str(e) for e in outs[1:-1]]
    assert all(isinstance(e, ValueError) for e in outs[1:-1]), outs
    assert "input_ids: empty prompt" in messages[0]
    assert f"input_ids[2]: token id {VOCAB}" in messages[1]
    assert messages[2].startswith("cache_salt") and messages[3].startswith("extra_key")
    for r, out in ((good[0], outs[0]), (good[1], outs[-1])):
        assert out.output_ids == expected(model, r)
    with pytest.raises(ValueError, match="prefill_worker"):
        cluster.generate(req(tokens(5, 5)), prefill_worker=9)
    assert_idle(cluster)


def test_a_lone_long_prompt_borrows_the_idle_cores_and_gives_them_back(
        cluster: PDCluster, model: Model) -> None:
    """With every other worker of the node idle (their slots in the node's core ledger at
    0), a long prompt's forward runs on more threads, a short one's does not; both answers
    are the no-cache ones, and every core is given back after (``assert_idle``)."""
    if node_cores() < 2:
        pytest.skip("one core: nothing to lend")
    assert_idle(cluster)

    def borrowed() -> int:
        return sum(s.get("cores/borrowed", 0) for s in cluster.engine_stats().values())

    start = borrowed()
    long = req(tokens(400, LEND_MIN_TOKENS + 40), (None, "lend"), max_new=4)
    assert cluster.generate(long).output_ids == expected(model, long)
    assert borrowed() == start + 1
    short = req(tokens(401, LEND_MIN_TOKENS // 4), (None, "lend"), max_new=4)
    assert cluster.generate(short).output_ids == expected(model, short)
    assert borrowed() == start + 1
    assert_idle(cluster)


def test_decode_calls_in_flight_share_batched_steps(cluster: PDCluster, model: Model) -> None:
    """Decode calls sent together to one actor run as one continuous batch (the actor
    takes them concurrently); each answer still equals the no-cache output."""
    reqs = [req(tokens(300 + i, 9 + 2 * i), max_new=16) for i in range(6)]
    before = sum(s.get("decode/step", 0) for s in cluster.engine_stats().values())

    async def run() -> list[Any]:
        prefilled = await asyncio.gather(*(cluster._prefill(r, cluster.router_names(r), None)
                                           for r in reqs))
        return await asyncio.gather(*(cluster._decode(r, info, ref, 0)
                                      for r, (info, ref) in zip(reqs, prefilled)))

    outs = asyncio.run(run())
    for r, out in zip(reqs, outs):
        assert out.output_ids == expected(model, r), r.rid
    steps = sum(s.get("decode/step", 0) for s in cluster.engine_stats().values()) - before
    assert steps < sum(r.max_new_tokens - 1 for r in reqs)
    assert_idle(cluster)


def test_drop_caches_empties_every_tier_and_the_next_request_computes_all(
        cluster: PDCluster, model: Model) -> None:
    prompt = tokens(9001, 41)
    first = req(prompt, (None, "drop-test"))
    assert cluster.generate(first).output_ids == expected(model, first)
    cluster.flush()
    # The prompt's pages are now held: in the serving worker's L1 and in L3.
    names = cluster.router_names(first)
    assert cluster.l3_holds(names) == len(names) == 10
    assert any(s.pool_usage["device"].get("radix") for s in cluster.states())

    dropped = cluster.drop_caches()

    assert dropped["device"] > 0 and dropped["storage"] > 0, dropped
    for state in cluster.states():   # nothing cached anywhere, nothing leaked
        assert state.locks == 0
        assert not state.pool_usage["device"].get("radix"), state
        assert not state.pool_usage["host"].get("radix"), state
    assert [ray.get(s.usage.remote()).records for s in cluster.storage] == [0, 0]
    assert cluster.l3_holds(names) == 0
    again = req(prompt, (None, "drop-test"))
    out = cluster.generate(again)
    assert out.output_ids == expected(model, again)
    assert sum(out.cached_tokens.values()) == 0, out.cached_tokens   # computed from scratch
    assert_idle(cluster)


def test_clients_at_their_own_pace_send_each_turn_after_their_own_answer(
        cluster: PDCluster, model: Model) -> None:
    """The bench's closed loop without ``lockstep`` (bench_pd's shape): every turn's prompt
    holds the client's earlier answers, every answer is the model's own, and a turn leaves
    once its client's previous answer is in."""
    wl = chat(2, 2, system=13, user=5, output=4, seed=23)
    run = closed_loop(cluster, wl, lockstep=False)
    check_answers(model, wl, run)
    recs = {r.index: r for r in run.records}
    for spec in wl.requests:
        if spec.depends_on is not None:
            assert recs[spec.index].sent_s >= recs[spec.depends_on].end_s, spec.index
    assert sum(r.cached_tokens for r in run.records if r.turn > 0) > 0
    assert_idle(cluster)


def test_l3_calls_per_turn_at_the_shards_and_a_stale_index_hint(cluster: PDCluster,
                                                                 model: Model) -> None:
    """Two turns of a conversation on two workers make the L3 calls the shards count (one
    get, one write-through, one offload a turn; no exists), on the one shard its names
    place it on; a prefill told L3 holds more than it does reads what is there, counts the
    rest stale_index, and answers as the model does."""
    ns = (None, "l3-calls")
    before = cluster.l3_calls()
    records = [ray.get(s.usage.remote()).records for s in cluster.storage]
    first = req(tokens(9100, 41), ns, max_new=6)            # 10 full pages
    out1 = cluster.generate(first, prefill_worker=0, decode_worker=0)
    cluster.flush()
    second = req(first.input_ids + out1.output_ids + tokens(9101, 9), ns, max_new=6)
    out2 = cluster.generate(second, prefill_worker=1, decode_worker=1)
    cluster.flush()
    assert out2.output_ids == expected(model, second)
    assert out2.cached_tokens["storage"] == 11 * PS         # turn one's prompt and answer
    calls = {op: n - before[op] for op, n in cluster.l3_calls().items()}
    assert calls == {"exists": 0, "get": 2, "set": 4}
    names = cluster.router_names(second) + [b"\0" * 16]     # 14 prompt pages (+1 offloaded)
    owner = cluster.storage_client().shards_of(names, [])
    assert len(set(owner)) == 1                             # one segment: one shard
    added = [ray.get(s.usage.remote()).records - n for s, n in zip(cluster.storage, records)]
    assert added[owner[0]] == 10 + 1 + 3 + 1 and added[1 - owner[0]] == 0
    assert cluster.l3_holds(names[:-1]) == 14

    third = req(second.input_ids + out2.output_ids + tokens(9102, 9), ns, max_new=4)
    full = len(third.input_ids) // PS                       # 17; L3 holds 15 of them
    misses = ray.get(cluster.prefill[0].engine_stats.remote()).get("miss/stale_index", 0)
    info_ref, *handoff = cluster.prefill[0].prefill.remote(third, 0, full)
    info = ray.get(info_ref)
    done = ray.get(cluster.decode[0].decode_handoff.remote(third, info, handoff))
    assert [info.first_token, *done.output_ids[1:]] == done.output_ids == \
        expected(model, third)
    assert info.cached_tokens["device"] == 10 * PS and info.cached_tokens["storage"] == 5 * PS
    stats = ray.get(cluster.prefill[0].engine_stats.remote())
    assert stats["miss/stale_index"] - misses == 2          # pages 15 and 16
    cluster.flush()
    assert cluster.l3_holds(cluster.router_names(third)) == full   # the write filled them
    assert_idle(cluster)
