"""What the decode worker tests share: one turn through an in-process prefill and decode
worker pair, and the check that both are idle after a scenario."""

from __future__ import annotations

from pd_cache.core.request import Req
from pd_cache.worker.workers import DecodeWorker, PrefillWorker


def turn(p: PrefillWorker, d: DecodeWorker, req: Req, reserve: bool = True) -> tuple:
    kept = d.reserve(req) if reserve else 0
    info, pages, states = p.prefill(req, kept)
    assert pages.shape[0] == info.sent_pages == info.num_kv_pages - kept
    return d.decode(req, info, pages, states=states), info


def clean(*workers: PrefillWorker | DecodeWorker) -> None:
    for w in workers:
        state = w.state()
        assert state.locks == 0, (w.role, state)
        for pool in state.pool_usage.values():
            assert set(pool) <= {"radix"}, (w.role, state.pool_usage)
