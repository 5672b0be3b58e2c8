"""The reader checks a record's name against its own request's tokens (L3 has none).

End to end through ``LocalEngine`` over an in-process backend: whatever record reaches the
reader under a name its own tokens do not hash to, it is a miss, the page is recomputed,
and the output is the model's without a cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_cache.core.hashing import page_hashes
from pd_cache.core.request import Req
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.base import ExtraInfo, PoolTransfer, StorageBackend
from pd_cache.worker.engine import LocalEngine
from tests.unit.tiering.fakes import (
    PS,
    Wrapper,
    assert_clean,
    config,
    filled_store,
    prompt,
    reference,
)


class Misfiled(Wrapper):
    """Hands out, for ``victim``, the record filed under ``source``: another page's payload
    and name, as a store that mixed up its name mapping would."""

    def __init__(self, inner: StorageBackend, victim: bytes, source: bytes) -> None:
        super().__init__(inner)
        self.victim, self.source = victim, source

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        out = super().batch_get_v2(transfers, extra_info)
        keys, pages = list(transfers[0].keys), list(out[0].pages or [])
        if self.victim in keys:
            i = keys.index(self.victim)
            # NOTE: the chain before the source page, so the store's own chain check passes.
            info = ExtraInfo(prefix_keys=[], namespace_seed=extra_info.namespace_seed) \
                if i == 0 and extra_info is not None else None
            pages[i] = self.inner.batch_get([self.source], info)[0]
        return [PoolTransfer(transfers[0].pool, keys, pages)]


def test_a_record_filed_under_another_pages_name_is_recomputed() -> None:
    cfg = config(batch=3)
    a, b = prompt(51, 42), prompt(52, 42)
    store = filled_store(cfg, [Req(rid="a", input_ids=a, max_new_tokens=1),
                               Req(rid="b", input_ids=b, max_new_tokens=1)])
    names_a, names_b = page_hashes(a, PS), page_hashes(b, PS)
    engine = LocalEngine(cfg, storage=Misfiled(store, names_b[4], names_a[4]))
    r = Req(rid="r", input_ids=b, max_new_tokens=6)
    result = engine.generate(r)
    assert result.output_ids == reference(engine, r)
    assert result.cached_tokens["storage"] == 4 * PS  # the pages before the misfiled one
    assert engine.stats.get(Event.MISS, MissReason.VERIFICATION_FAILED) > 0
    assert engine.flush(10)
    assert_clean(engine)
    engine.close()


def test_pages_asked_for_under_names_of_other_tokens_are_refused() -> None:
    cfg = config(batch=3)
    a, b = prompt(53, 42), prompt(54, 42)
    store = filled_store(cfg, [Req(rid="a", input_ids=a, max_new_tokens=1)])
    names_a = page_hashes(a, PS)
    engine = LocalEngine(cfg, storage=store)
    real = engine.controller.reader.prefetch

    def mapped(req: Req, names: Sequence[bytes], prefix: Sequence[bytes] = (),
               **hint: object) -> object:
        # A naming bug upstream: b's request asks for a's pages (same namespace, so the
        # store's chain check and the seed audit pass; only b's own tokens tell).
        return real(req, names_a[len(prefix):len(prefix) + len(names)], prefix, **hint)

    engine.controller.reader.prefetch = mapped
    r = Req(rid="r", input_ids=b, max_new_tokens=8)
    result = engine.generate(r)
    assert result.output_ids == reference(engine, r)
    assert result.cached_tokens["storage"] == 0
    assert engine.stats.get(Event.MISS, MissReason.VERIFICATION_FAILED) > 0
    assert engine.stats.get(Event.VERIFICATION_FAILED, "storage") == 1
    assert engine.flush(10)
    assert_clean(engine)
    engine.close()
