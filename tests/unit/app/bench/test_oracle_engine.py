"""The oracle's expected cached tokens equal what a real engine with L3 serves: a multi-turn
chat run request by request through ``LocalEngine`` (reference model, in-memory L3)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pd_cache.app.bench.oracle import OracleRequest, simulate  # noqa: E402
from pd_cache.app.bench.workloads import multi_turn_workload  # noqa: E402
from pd_cache.core.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    PDCacheConfig,
    StorageConfig,
)
from pd_cache.core.request import Req  # noqa: E402
from pd_cache.storage import make_backend  # noqa: E402
from pd_cache.worker.engine import LocalEngine  # noqa: E402

PS = 4


@pytest.mark.parametrize("output_tokens", [5, 7, 8])
def test_oracle_matches_the_engine(output_tokens: int) -> None:
    cfg = PDCacheConfig(model=ModelConfig.preset("tiny"),
                        cache=CacheConfig(page_size=PS, device_pages=256, host_pages=256),
                        storage=StorageConfig())
    w = multi_turn_workload(2, 2, 3, system_tokens=10, user_tokens=3,
                            output_tokens=output_tokens, vocab_size=cfg.model.vocab_size,
                            seed=3)
    answers: dict[int, list[int]] = {}
    served, ran = {}, []
    # NOTE: prefill and decode in separate engines, as in the cluster: the prefill side's
    # own cache holds prompt pages only; the answer pages reach the next turn through L3.
    store = make_backend(cfg.storage, cfg.layout)
    prefill_side = LocalEngine(cfg, storage=store)
    decode_side = LocalEngine(cfg, storage=store)
    for r in w.requests:
        ids = r.prompt_ids(answers)
        req = Req(rid=f"r{r.index}", input_ids=ids, cache_salt=r.cache_salt,
                  extra_key=r.extra_key, max_new_tokens=r.max_tokens)
        out = prefill_side.prefill(req)
        answers[r.index] = decode_side.decode(req, out.kv_pages, out.num_prompt_tokens,
                                              out.first_token)
        assert prefill_side.flush(10) and decode_side.flush(10)
        served[r.index] = sum(out.cached_tokens.values())
        ran.append(OracleRequest(r.index, r.cache_salt, r.extra_key, ids, answers[r.index],
                                 float(r.index), r.index + 0.5))
    prefill_side.close()
    decode_side.close()
    expected = simulate(ran, page_size=PS, algo=cfg.cache.hash_algo).ideal_hit_tokens
    assert served == expected
    assert any(n > 10 // PS * PS for n in expected.values())   # answers were reused
