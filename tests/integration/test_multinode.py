"""The PD cluster across two Ray nodes on this machine (``ray.cluster_utils.Cluster``).

Prefill actors run on node A (with the driver), decode and two storage actors on node B, a
third storage actor on node A, so the prompt's KV reaches decode through Ray's object
manager (node A's object store -> node B's) rather than shared memory, and a prefill
worker's L3 prefetch crosses nodes too. With ``storage_replicas: 2`` each page has one copy
on node A and one on node B.

This module starts its own cluster: it ends the session's single-node Ray if one is up and
does not start it again, so it runs after every other test (see the integration conftest).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from pd_cache.app.bench.workloads import multi_turn_workload
from pd_cache.app.session import ClusterToken
from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.request import Req
from pd_cache.core.sealing import Keyring
from pd_cache.model.model import Model, reference_generate
from tests.integration.clusters import l3_records, until

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from pd_cache.storage import tier  # noqa: E402
from pd_cache.worker import actors  # noqa: E402

pytestmark = pytest.mark.multinode

PS = 4
CONFIG = ClusterConfig(model="tiny", page_size=PS, num_prefill=2, num_decode=1, num_storage=3,
                       storage_replicas=2, device_pages=64, host_pages=128,
                       storage_capacity_bytes=1 << 25, storage_timeout_s=10.0)
VOCAB = CONFIG.pd_config.model.vocab_size
NODE_A, NODE_B = "node_a", "node_b"
STORE_BYTES = 128 << 20   # per node; 150 MiB is Cluster's default
INLINE_BYTES = 512        # objects above this go to the object store (Ray's default: 100 KiB)


class Nodes(NamedTuple):
    a: str   # node ids
    b: str


@pytest.fixture(scope="module")
def nodes(request: pytest.FixtureRequest, ray_token: ClusterToken) -> Iterator[Nodes]:
    # NOTE: the session's single-node Ray (if a test before started it) cannot stay: a
    # driver talks to one cluster. It is ended here and not restarted, which is safe only
    # while no test after this module needs it.
    items = request.session.items
    first = next(i for i, item in enumerate(items)
                 if getattr(item, "module", None) is request.module)
    later = [item.nodeid for item in items[first:] if "ray_cluster" in item.fixturenames]
    assert not later, f"these need the session's Ray but run after the multinode tests: {later}"
    ray.shutdown()
    with pytest.MonkeyPatch.context() as env:
        # both nodes inherit the session's token authentication (ray_token, in the conftest)
        # NOTE: the nodes bind 127.0.0.1; without this, ray.init resolves the loopback
        # address it is given to the machine's address, where nothing listens.
        env.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        common = {"num_cpus": 2, "node_ip_address": "127.0.0.1",
                  "object_store_memory": STORE_BYTES}
        # NOTE: the tiny model's KV is a few KiB a request, which Ray would inline in the
        # reply to the caller (under 100 KiB); a real model's never is. A low inline limit
        # sends every handoff through the object stores, as in a deployment.
        cluster = Cluster(initialize_head=True, head_node_args={
            **common, "resources": {NODE_A: 100}, "include_dashboard": False,
            "_system_config": {"max_direct_call_object_size": INLINE_BYTES}})
        try:
            node_b = cluster.add_node(**common, resources={NODE_B: 100})
            ray.init(address=cluster.address, logging_level="WARNING")
            yield Nodes(cluster.head_node.node_id, node_b.node_id)
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture(scope="module")
def cluster(nodes: Nodes) -> Iterator[PDCluster]:
    pd, on_a, on_b = CONFIG.pd_config, {"resources": {NODE_A: 1}}, {"resources": {NODE_B: 1}}
    # NOTE: storage_actors takes no Ray resources: the shards are made as it makes them,
    # plus the resource that pins them to node B (shards 0, 1) or A (shard 2).
    storage = [ray.remote(tier.StorageTier).options(
        num_cpus=0, runtime_env={"env_vars": dict(tier.ACTOR_ENV)},
        **(on_b if i < 2 else on_a)).remote(pd, i) for i in range(pd.storage.num_shards)]
    opts = {"threads": CONFIG.threads, "storage_timeout_s": CONFIG.storage_timeout_s,
            "keyring": Keyring.random()}   # one cluster: every worker reads the others' pages
    prefill = [actors.prefill_actor(pd, i, storage, actor=on_a, **opts)
               for i in range(CONFIG.num_prefill)]
    decode = [actors.decode_actor(pd, i, storage, max_batch=CONFIG.decode_batch, actor=on_b,
                                  **opts) for i in range(CONFIG.num_decode)]
    ray.get([a.ready.remote() for a in prefill + decode] + [s.ping.remote() for s in storage])
    c = PDCluster(CONFIG, prefill, decode, storage)
    yield c
    c.shutdown(check=True)  # raises if any worker leaked a lock or a slot


def node_of(actor: Any) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def expected(model: Model, r: Req) -> list[int]:
    return reference_generate(model, Req(rid="ref", input_ids=r.input_ids,
                                         max_new_tokens=r.max_new_tokens)).output_ids


def test_roles_run_on_the_nodes_they_were_placed_on(cluster: PDCluster, nodes: Nodes) -> None:
    assert nodes.a != nodes.b
    assert [node_of(a) for a in cluster.prefill] == [nodes.a] * CONFIG.num_prefill
    assert [node_of(a) for a in cluster.decode + cluster.storage] == \
        [nodes.b] * (CONFIG.num_decode + 2) + [nodes.a]


def test_handed_off_pages_are_copied_to_the_decode_node(cluster: PDCluster,
                                                         nodes: Nodes) -> None:
    r = Req(rid="handoff", input_ids=random.Random(5).sample(range(VOCAB), 13),
            cache_salt="tenant-h", max_new_tokens=3)
    info_ref, pages_ref, _ = cluster.prefill[0].prefill.remote(r)
    out = ray.get(cluster.decode[0].decode_handoff.remote(r, ray.get(info_ref), [pages_ref]))
    assert out.pages_received == -(-13 // PS)
    # made on A, pulled to B by the object manager (B reports its copy asynchronously)
    deadline, where = time.monotonic() + 10, set()
    while where != {nodes.a, nodes.b} and time.monotonic() < deadline:
        where = set(ray.experimental.get_object_locations([pages_ref])[pages_ref]["node_ids"])
        time.sleep(0.1)
    assert where == {nodes.a, nodes.b}


def test_two_tenants_over_turns_equal_the_reference(cluster: PDCluster) -> None:
    model = Model(CONFIG.pd_config.model)
    user_tokens = 7
    wl = multi_turn_workload(2, 1, 3, system_tokens=10, user_tokens=user_tokens,
                             output_tokens=6, vocab_size=VOCAB, seed=23)
    assert {r.extra_key for r in wl.requests} == {None, "adapter-1"}   # one on a LoRA
    answers: dict[int, list[int]] = {}
    done = []
    for turn in range(3):
        specs = [spec for spec in wl.requests if spec.turn == turn]
        reqs = [Req(rid=f"{spec.session}/{turn}", input_ids=spec.prompt_ids(answers),
                    extra_key=spec.extra_key, cache_salt=spec.cache_salt,
                    max_new_tokens=spec.max_tokens) for spec in specs]
        # turn 0 on prefill 0, turn 1 on prefill 1 (which has not seen turn 0: L3 serves
        # it), turn 2 wherever the router sends it
        worker = {0: 0, 1: 1}.get(turn)
        outs = cluster.generate_many(reqs) if worker is None else \
            [cluster.generate(r, prefill_worker=worker) for r in reqs]
        cluster.flush()   # write-through and offload landed before the next turn looks
        for spec, r, out in zip(specs, reqs, outs):
            assert out.output_ids == expected(model, r), r.rid
            answers[spec.index] = out.output_ids
            done.append((turn, len(r.input_ids), out))
    for turn, n, out in done:
        assert out.cross_namespace_tokens == 0
        if turn == 0:
            assert sum(out.cached_tokens.values()) == 0
        if turn == 1:
            # the pages with KV after turn 0: its prompt (prefill's write-through) and its
            # answer (decode's offload on node B), fetched by node A's other worker
            before = n - user_tokens
            assert out.cached_tokens == {"device": 0, "host": 0,
                                         "storage": PS * ((before - 1) // PS)}, out
    assert {out.decode_worker for *_, out in done} == {0}
    for state in cluster.states():
        assert state.locks == 0, state
        owners = {owner for pool in state.pool_usage.values() for owner in pool}
        assert owners <= {"radix"}, state


def test_replicas_sit_on_both_nodes_and_outlive_one_nodes_shard(cluster: PDCluster) -> None:
    """Every page has a copy on node A's shard and one on node B's two; once node A's shard
    is killed (for good: made without restarts), the next turn still hits L3 for all."""
    until(lambda: (lambda n: n[2] == n[0] + n[1] > 0)(l3_records(cluster)),
          "a copy of every page on each node")
    model = Model(CONFIG.pd_config.model)
    first = Req(rid="rep/0", input_ids=random.Random(31).sample(range(VOCAB), 14),
                cache_salt="tenant-r", max_new_tokens=6)
    first_out = cluster.generate(first, prefill_worker=0)
    cluster.flush()
    after = Req(rid="rep/1", input_ids=first.input_ids + first_out.output_ids + [7, 8, 9],
                cache_salt="tenant-r", max_new_tokens=4)
    held = cluster.l3_holds(cluster.router_names(after))
    assert held == (len(first.input_ids) + len(first_out.output_ids) - 1) // PS
    until(lambda: (lambda n: n[2] == n[0] + n[1])(l3_records(cluster)), "both copies landed")
    pid = ray.get(cluster.storage[2].ping.remote())
    os.kill(pid, signal.SIGKILL)
    out = cluster.generate(after, prefill_worker=1)   # prefill 1 never saw the first turn
    assert out.output_ids == expected(model, after)
    assert out.cached_tokens == {"device": 0, "host": 0, "storage": PS * held}, out
