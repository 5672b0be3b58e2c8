"""Metrics recorded by the component that does the work, without Ray: the tiering layer
(prefetch, write-through, offload, by outcome), the decode batcher (inter-token and queue
time) and the workers (prefix-cache queries, E2E). Each figure must equal what the
workload itself counted."""

from __future__ import annotations

import time
from pathlib import Path

from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req
from pd_cache.metrics import METRICS, PDCacheMetrics, markdown_table
from pd_cache.storage import make_backend
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.workers import DecodeWorker, PrefillWorker
from tests.unit.tiering.fakes import PS, Faulty, SetGate, config, prompt

METRICS_DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def value(m: PDCacheMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def by_outcome(m: PDCacheMetrics, name: str, backend: str = "memory") -> dict[str, float]:
    return {o: value(m, name, backend=backend, outcome=o) for o in ("ok", "short", "failed")}


def test_a_second_turn_on_another_worker_is_counted_where_it_happens() -> None:
    cfg = config(batch=3, policy="wait_complete")
    store = make_backend(cfg.storage, cfg.layout)
    m0, m1, md = (PDCacheMetrics("prometheus") for _ in range(3))
    p0 = PrefillWorker(cfg, worker_id=0, storage=store, metrics=m0)
    p1 = PrefillWorker(cfg, worker_id=1, storage=store, metrics=m1)
    decode = DecodeWorker(cfg, storage=store, metrics=md, max_batch=4)
    data = p0.engine.host_pool.data
    page_bytes = data[0].numel() * data.element_size()

    reqs = [Req(rid=f"r{i}", input_ids=prompt(i, 30 + i), max_new_tokens=5) for i in range(3)]
    for req in reqs:
        res = p0.prefill(req)
        decode.decode(req, res.info, res.kv_pages)
    assert p0.flush(10) and decode.flush(10)
    second = p1.prefill(Req(rid="again", input_ids=reqs[0].input_ids, max_new_tokens=1))
    storage_tokens = second.info.cached_tokens["storage"]
    assert storage_tokens > 0

    # Prefetch: pages landed = storage cached tokens / page size, all of them "ok".
    pages = by_outcome(m1, "pd_cache_prefetch_pages_total")
    assert pages == {"ok": storage_tokens // PS, "short": 0, "failed": 0}
    assert value(m1, "pd_cache_prefetch_bytes_total", backend="memory",
                 outcome="ok") == storage_tokens // PS * page_bytes
    assert value(m1, "pd_cache_prefetch_seconds_count", backend="memory", outcome="ok") == 1
    assert sum(by_outcome(m0, "pd_cache_prefetch_pages_total").values()) == 0

    # Write-through and offload: what L3 acknowledged, each in its own process.
    assert value(m0, "pd_cache_backup_pages_total", backend="memory",
                 outcome="ok") == p0.l3_writes()["backup"] > 0
    assert value(md, "pd_cache_backup_pages_total", backend="memory",
                 outcome="ok") == decode.l3_writes()["offload"] > 0
    offload = decode.engine.stats
    for kind in ("prompt", "generated"):
        assert value(md, "pd_cache_offload_pages_total", page_kind=kind) == \
            offload.get("offload", kind)

    # Decode: one inter-token gap per token drawn after the first, one queue wait and
    # one E2E per request; prefill looks up every full page before the last token.
    drawn = sum(r.max_new_tokens - 1 for r in reqs)
    assert value(md, "pd_cache_inter_token_seconds_count", role="decode") == drawn
    assert value(md, "pd_cache_queue_seconds_count", role="decode") == len(reqs)
    assert value(md, "pd_cache_e2e_seconds_count") == len(reqs)
    assert value(m0, "pd_cache_prefix_cache_queries_tokens_total") == \
        sum((len(r.input_ids) - 1) // PS * PS for r in reqs)
    assert value(m1, "pd_cache_cached_tokens_total", tier="storage") == storage_tokens
    for w in (p0, p1, decode):
        w.close()


def test_a_corrupted_record_makes_a_short_prefetch() -> None:
    cfg = config(batch=3, policy="wait_complete")
    p = prompt(7, 42)
    names = page_hashes(p, PS)
    store = make_backend(cfg.storage, cfg.layout)
    donor = LocalEngine(cfg, storage=store)
    donor.prefill(Req(rid="d", input_ids=p, max_new_tokens=1))
    assert donor.flush(10)
    m = PDCacheMetrics("prometheus")
    reader = LocalEngine(cfg, storage=Faulty(store, "corrupt", names[4]), metrics=m)
    out = reader.prefill(Req(rid="r", input_ids=p, max_new_tokens=1))
    assert out.cached_tokens["storage"] == 4 * PS
    assert by_outcome(m, "pd_cache_prefetch_pages_total") == {"ok": 0, "short": 4, "failed": 0}
    for e in (donor, reader):
        e.close()


def test_a_refused_write_is_counted_by_outcome() -> None:
    cfg = config(batch=3)
    p = prompt(11, 42)
    names = page_hashes(p, PS)
    # Batches of 3 pages: a refusal in the second one stores 3 (short), in the first none.
    for refuse, outcome, stored in ((names[4], "short", 3), (names[0], "failed", 0)):
        m = PDCacheMetrics("prometheus")
        store = SetGate(make_backend(cfg.storage, cfg.layout), refuse=refuse)
        store.gate.set()
        engine = LocalEngine(cfg, storage=store, metrics=m)
        engine.prefill(Req(rid="r", input_ids=p, max_new_tokens=1))
        assert engine.flush(10)
        engine.close()
        want = {o: float(o == outcome) for o in ("ok", "short", "failed")}
        assert by_outcome(m, "pd_cache_backup_seconds_count") == want
        assert sum(by_outcome(m, "pd_cache_backup_pages_total").values()) == stored


def test_a_write_queued_behind_another_records_its_wait() -> None:
    cfg = config(batch=3)
    m = PDCacheMetrics("prometheus")
    store = SetGate(make_backend(cfg.storage, cfg.layout))
    engine = LocalEngine(cfg, storage=store, metrics=m)
    for i in (21, 22):   # two writes issued; the first is held at its set
        engine.prefill(Req(rid=f"r{i}", input_ids=prompt(i, 42), max_new_tokens=1))
    held = time.perf_counter()
    time.sleep(0.3)      # the second write cannot begin before the first ends, after this
    store.gate.set()
    assert engine.flush(10)
    held = time.perf_counter() - held
    engine.close()
    wait = "pd_cache_backup_wait_seconds"
    assert value(m, f"{wait}_count", backend="memory") == 2
    assert value(m, f"{wait}_sum", backend="memory") >= 0.3
    # the second write's wait (at least the hold) lies above the 0.25 s bucket
    assert value(m, f"{wait}_bucket", backend="memory", le="0.25") <= 1
    assert value(m, f"{wait}_sum", backend="memory") <= 2 * held   # each at most the run


def test_the_docs_table_is_the_generated_one() -> None:
    text = METRICS_DOC.read_text()
    assert markdown_table() in text
    assert all(f"`{spec.name}`" in text for spec in METRICS)
