"""Engines on the tiny model over a real memory backend, for the unit tests of the cache
tiers and the workers: configs, prompts, the no-cache answer, a backend filled by a donor
engine, the idle check, and backend wrappers that record calls or inject one fault.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

from pd_cache.core.config import CacheConfig, ModelConfig, PDCacheConfig, StorageConfig
from pd_cache.core.request import Req
from pd_cache.model.model import reference_generate
from pd_cache.storage import make_backend
from pd_cache.storage.base import ExtraInfo, Pending, PoolTransfer, StorageBackend
from pd_cache.storage.record import PageRecord
from pd_cache.worker.engine import LocalEngine

PS = 4
TINY = ModelConfig.preset("tiny")

# Small pools, and a prefetch that waits for every batch: the workers' and batcher's tests.
SMALL = PDCacheConfig(model=TINY, cache=CacheConfig(page_size=PS, device_pages=16, host_pages=32),
                      storage=StorageConfig(prefetch_policy="wait_complete"))


def config(batch: int = 3, policy: str = "best_effort", prefix_keys: bool = True,
           host: int = 64, **storage: Any) -> PDCacheConfig:
    return PDCacheConfig(model=TINY, cache=CacheConfig(page_size=PS, device_pages=64,
                                                       host_pages=host),
                         storage=StorageConfig(batch_pages=batch, prefetch_policy=policy,
                                               prefix_keys=prefix_keys, **storage))


def prompt(seed: int, n: int = 42) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY.vocab_size) for _ in range(n)]


def reference(engine: LocalEngine, r: Req) -> list[int]:
    fresh = Req(rid="ref", input_ids=r.input_ids, max_new_tokens=r.max_new_tokens)
    return reference_generate(engine.model, fresh).output_ids


class Wrapper(StorageBackend):
    """Delegates to a real backend; subclasses change one call. Records every ExtraInfo."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner, self.algo = inner, inner.algo
        self.calls: list[tuple[str, list[bytes], ExtraInfo | None, list[bytes] | None]] = []

    def _record(self, op: str, transfers: Sequence[PoolTransfer],
                info: ExtraInfo | None) -> None:
        prefix = info.prefix_keys if info is not None else None
        # NOTE: keep the list object and a copy: a later mutation would make them differ.
        self.calls.append((op, list(transfers[0].keys), info,
                           None if prefix is None else list(prefix)))

    def batch_exists_v2(self, transfers: Sequence[PoolTransfer],
                        extra_info: ExtraInfo | None = None) -> Any:
        self._record("exists", transfers, extra_info)
        return self.inner.batch_exists_v2(transfers, extra_info)

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        self._record("get", transfers, extra_info)
        return self.inner.batch_get_v2(transfers, extra_info)

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        self._record("set", transfers, extra_info)
        return self.inner.batch_set_v2(transfers, extra_info)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def usage(self) -> Any:
        return self.inner.usage()

    def gets(self) -> list[list[bytes]]:
        return [keys for op, keys, _, _ in self.calls if op == "get"]


def _with_pages(transfers: list[PoolTransfer], pages: list[PageRecord | None]) -> list[Any]:
    return [PoolTransfer(transfers[0].pool, transfers[0].keys, pages)]


class Faulty(Wrapper):
    """Injects one fault into ``batch_get``: ``short`` (the 2nd batch's tail missing),
    ``missing_middle`` (one page in the middle), ``corrupt`` (a payload altered after the
    store verified it), ``raises``."""

    def __init__(self, inner: StorageBackend, mode: str, victim: bytes) -> None:
        super().__init__(inner)
        self.mode, self.victim = mode, victim

    def batch_get_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[PoolTransfer]:
        out = super().batch_get_v2(transfers, extra_info)
        pages = list(out[0].pages or [])
        keys = list(transfers[0].keys)
        if self.mode == "raises" and self.victim in keys:
            raise RuntimeError("storage node went away")
        if self.victim in keys:
            i = keys.index(self.victim)
            if self.mode == "short":
                pages = pages[:i]
            elif self.mode == "missing_middle":
                pages[i] = None
            elif self.mode == "corrupt":
                rec = pages[i]
                bad = rec.payloads[0].clone()
                bad.view(-1)[0] += 1.0
                pages[i] = PageRecord(rec.header, (bad,))
        return _with_pages(out, pages)


class _Later(Pending[Any]):
    """A result computed now but released only when ``gate`` is set (or never)."""

    def __init__(self, value: Any, gate: threading.Event, log: list[str]) -> None:
        self.value, self.gate, self.log = value, gate, log

    def done(self) -> bool:
        return self.gate.is_set()

    def result(self, timeout: float | None = None) -> Any:
        self.log.append("result-before-done" if not self.gate.is_set() else "result")
        if not self.gate.wait(timeout):
            return [PoolTransfer(v.pool, v.keys, [None] * len(v.keys)) for v in self.value]
        return self.value


class Delayed(Wrapper):
    """Asynchronous gets: the batches whose first key is in ``slow`` answer only when
    ``gate`` is set (a storage call that does not return in time)."""

    def __init__(self, inner: StorageBackend, slow: set[bytes]) -> None:
        super().__init__(inner)
        self.slow, self.gate, self.log = slow, threading.Event(), []
        self.ready_gate = threading.Event()
        self.ready_gate.set()

    def submit_get_v2(self, transfers: Sequence[PoolTransfer],
                      extra_info: ExtraInfo | None = None) -> Pending[list[PoolTransfer]]:
        value = self.batch_get_v2(transfers, extra_info)
        gate = self.gate if transfers[0].keys[0] in self.slow else self.ready_gate
        return _Later(value, gate, self.log)


def filled_store(cfg: PDCacheConfig, prompts: list[Req]) -> StorageBackend:
    """A memory backend holding the prompts' pages, written by a donor engine."""
    store = make_backend(cfg.storage, cfg.layout)
    donor = LocalEngine(cfg, storage=store)
    for r in prompts:
        donor.prefill(r)
    assert donor.flush(10)
    donor.close()
    return store


def assert_clean(engine: LocalEngine) -> None:
    """No lock, and no slot held by anything but the radix tree; then nothing at all."""
    assert engine.locks_held() == 0
    usage = engine.pool_usage()
    assert set(usage["device"]) <= {"radix"} and set(usage["host"]) <= {"radix"}, usage
    engine.cache.clear()
    assert engine.pool_usage() == {"device": {}, "host": {}}


class SetGate(Wrapper):
    """``batch_set`` waits for ``gate``; ``refuse`` names a key whose batch is refused."""

    def __init__(self, inner: StorageBackend, refuse: bytes | None = None) -> None:
        super().__init__(inner)
        self.gate, self.refuse = threading.Event(), refuse

    def batch_set_v2(self, transfers: Sequence[PoolTransfer],
                     extra_info: ExtraInfo | None = None) -> list[list[bool]]:
        self.gate.wait(10)
        if self.refuse in transfers[0].keys:
            self._record("set", transfers, extra_info)
            return [[False] * len(transfers[0].keys)]
        return super().batch_set_v2(transfers, extra_info)


class Recorder(Wrapper):
    """A real backend behind a wrapper that keeps every v2 call it is handed, every pool."""

    def _record(self, op: str, transfers: Sequence[PoolTransfer],
                info: ExtraInfo | None) -> None:
        prefix = None if info is None or info.prefix_keys is None else list(info.prefix_keys)
        self.calls.append((op, [(t.pool, list(t.keys)) for t in transfers], info, prefix))
