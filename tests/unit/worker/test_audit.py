"""The namespace audit does not trust the lookup: a lookup made namespace-blind on purpose
still never serves one namespace's KV to another, at every tier and across the handoff."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.hashing import namespace_seed, page_hashes
from pd_cache.core.request import Req
from pd_cache.core.vocab import Event, MissReason
from pd_cache.kv import CacheKey
from pd_cache.model.model import Model, reference_generate
from pd_cache.storage import make_backend
from pd_cache.storage.base import ExtraInfo, PoolTransfer
from pd_cache.worker import engine as engine_module
from pd_cache.worker.engine import LocalEngine
from pd_cache.worker.workers import DecodeWorker, PrefillWorker
from tests.unit.tiering.fakes import Wrapper

PS = 4
TINY = ModelConfig.preset("tiny")


def config(**storage: Any) -> PDCacheConfig:
    return PDCacheConfig(model=TINY, cache=CacheConfig(page_size=PS, device_pages=64,
                                                       host_pages=64),
                         storage=StorageConfig(prefetch_policy="wait_complete", **storage))


def blind_key(req: Req, tokens: Any = None, *, page_size: int, algo: str = "xxh3_128") -> Any:
    """A lookup bug: names computed as if every request were in the empty namespace."""
    tokens = req.input_ids if tokens is None else tokens
    key = CacheKey.build(tokens, page_size=page_size, algo=algo)
    return key._replace(namespace=req.namespace)


@pytest.fixture
def blind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module.CacheKey, "for_request", staticmethod(blind_key))


def reference(model: Model, r: Req) -> list[int]:
    return reference_generate(model, Req(rid="ref", input_ids=r.input_ids,
                                         max_new_tokens=r.max_new_tokens)).output_ids


TOKENS = [(i * 37 + 11) % TINY.vocab_size for i in range(30)]


def test_a_namespace_blind_radix_lookup_is_caught_by_the_seed_audit(blind: None) -> None:
    engine = LocalEngine(config())
    a = Req(rid="a", input_ids=TOKENS, cache_salt="tenant-a", max_new_tokens=3)
    b = Req(rid="b", input_ids=TOKENS, cache_salt="tenant-b", max_new_tokens=3)
    engine.generate(a)
    result = engine.generate(b)
    full = (len(TOKENS) - 1) // PS
    assert sum(result.cached_tokens.values()) == 0
    assert engine.stats.get(Event.MISS, MissReason.CROSS_NAMESPACE) == full
    assert result.output_ids == reference(engine.model, b)
    again = engine.generate(Req(rid="a2", input_ids=TOKENS, cache_salt="tenant-a",
                                max_new_tokens=3))
    assert again.cached_tokens["device"] == full * PS     # its own namespace still hits
    assert engine.locks_held() == 0
    engine.close()


def test_without_the_bug_nothing_is_refused() -> None:
    engine = LocalEngine(config())
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        engine.generate(Req(rid=salt, input_ids=TOKENS, cache_salt=salt, max_new_tokens=2))
    assert engine.stats.get(Event.MISS, MissReason.CROSS_NAMESPACE) == 0
    engine.close()


class BlindStore(Wrapper):
    """A store whose lookup ignores the namespace: asked for a page of one namespace, it
    serves the page of the same tokens from another (``alias`` maps the names)."""

    def __init__(self, inner: Any, alias: dict[bytes, bytes]) -> None:
        super().__init__(inner)
        self.alias = alias

    def _blind(self, transfers: Sequence[PoolTransfer]) -> list[PoolTransfer]:
        return [msgspec.structs.replace(t, keys=[self.alias.get(k, k) for k in t.keys])
                for t in transfers]

    def batch_exists_v2(self, transfers: Sequence[PoolTransfer],
                        extra_info: ExtraInfo | None = None) -> Any:
        return self.inner.batch_exists_v2(self._blind(transfers), None)

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        got = self.inner.batch_get_v2(self._blind(transfers), None)
        return [msgspec.structs.replace(g, keys=t.keys) for g, t in zip(got, transfers)]


def test_a_namespace_blind_l3_lookup_is_caught_by_the_record_seed() -> None:
    cfg = config()
    store = make_backend(cfg.storage, cfg.layout)
    donor = LocalEngine(cfg, storage=store)
    a = Req(rid="a", input_ids=TOKENS, cache_salt="tenant-a", max_new_tokens=1)
    b = Req(rid="b", input_ids=TOKENS, cache_salt="tenant-b", max_new_tokens=3)
    donor.prefill(a)
    assert donor.flush(10)
    alias = dict(zip(page_hashes(TOKENS, PS, cache_salt="tenant-b"),
                     page_hashes(TOKENS, PS, cache_salt="tenant-a")))
    reader = LocalEngine(cfg, storage=BlindStore(store, alias))
    out = reader.prefill(b)
    assert out.cached_tokens["storage"] == 0
    full = (len(TOKENS) - 1) // PS
    assert out.cross_namespace_pages == full   # its first record refused: the batch is lost
    assert reader.stats.get(Event.MISS, MissReason.CROSS_NAMESPACE) == full
    tokens = reader.decode(b, out.kv_pages, out.num_prompt_tokens, out.first_token)
    assert tokens == reference(reader.model, b)
    assert not any(o.startswith("prefetch:") for o in reader.pool_usage()["host"])
    for e in (donor, reader):
        e.close()


def test_handed_off_kv_of_another_namespace_is_refused_and_recomputed() -> None:
    cfg = config()
    prefill, decode = PrefillWorker(cfg), DecodeWorker(cfg)
    a = Req(rid="x", input_ids=TOKENS, cache_salt="tenant-a", max_new_tokens=4)
    b = Req(rid="x", input_ids=TOKENS[:-1] + [TOKENS[0]], cache_salt="tenant-b",
            max_new_tokens=4)
    info, pages, _ = prefill.prefill(a)               # a router bug sends a's KV to b
    assert info.seed == namespace_seed(None, "tenant-a")
    out = decode.decode(b, info, pages)
    assert out.cross_namespace_pages == info.num_kv_pages
    assert out.output_ids == reference(decode.engine.model, b)
    assert decode.engine.stats.get(Event.MISS, MissReason.CROSS_NAMESPACE) == info.num_kv_pages
    ok = decode.decode(a, info, pages)
    assert ok.cross_namespace_pages == 0 and ok.output_ids == reference(decode.engine.model, a)
    prefill.close()
    decode.close()
