"""Decode routing on workers that share a few cores: packed and kept by conversation while
the cores are busy, spread to an idle decode worker when one batch would step alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from pd_cache.cluster.pd_cluster import PDCluster
from pd_cache.core.cluster_config import ClusterConfig
from pd_cache.core.wire import Completion
from pd_cache.model.model import Model
from tests.integration.clusters import assert_idle, expected, request, started, tokens

pytest.importorskip("ray")

# NOTE: two cores, as bench_pd's machine; decode_pack fills one decode batch first.
CONFIG = ClusterConfig(model="tiny", page_size=4, device_pages=128, host_pages=128,
                       num_storage=0, decode_pack=True, decode_spread_cores=2)
VOCAB = CONFIG.pd_config.model.vocab_size


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> Iterator[PDCluster]:
    yield from started(CONFIG)


def test_a_request_whose_decode_worker_is_busy_alone_goes_to_the_idle_one(
        cluster: PDCluster) -> None:
    """A long answer decodes on worker 0, nothing else runs: a conversation's next turn
    (kept on worker 0) and a new request (packed onto worker 0) both go to worker 1, the
    conversation's turn after follows it there; every answer is the model's own."""
    model = Model(CONFIG.pd_config.model)
    ns = (None, "spread")
    turn1 = request(tokens(1, 22, VOCAB), ns, max_new=6)
    out1 = cluster.generate(turn1)                          # alone: packed onto worker 0
    long = request(tokens(2, 20, VOCAB), (None, "long"), max_new=600)
    turn2 = request(turn1.input_ids + out1.output_ids + tokens(3, 7, VOCAB), ns, max_new=5)
    other = request(tokens(4, 18, VOCAB), (None, "other"), max_new=5)
    loads = cluster.decode_router.loads

    async def run() -> list[Completion]:
        busy = asyncio.ensure_future(cluster.generate_async(long))
        outs = []
        for r in (turn2, other):
            while not (loads[0] and not loads[1] and not any(cluster.prefill_router.loads)):
                assert not busy.done(), "the long answer ended before the scenario"
                await asyncio.sleep(0.002)
            outs.append(await cluster.generate_async(r))
        return [await busy, *outs]

    out_long, out2, out_other = asyncio.run(asyncio.wait_for(run(), 120))
    assert (out1.decode_worker, out_long.decode_worker) == (0, 0)
    assert (out2.decode_worker, out_other.decode_worker) == (1, 1)
    assert out2.pages_kept == 0                             # moved: handed the whole prompt
    turn3 = request(turn2.input_ids + out2.output_ids + tokens(5, 6, VOCAB), ns, max_new=4)
    out3 = cluster.generate(turn3)                          # idle cores: kept where it went
    assert out3.decode_worker == 1 and out3.pages_kept == (len(turn2.input_ids) + 4) // 4
    for r, out in ((turn1, out1), (long, out_long), (turn2, out2), (other, out_other),
                   (turn3, out3)):
        assert out.output_ids == expected(model, r), r.rid
    assert loads == [0, 0] and cluster.prefill_router.loads == [0, 0]
    assert_idle(cluster)
