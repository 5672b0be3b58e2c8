"""``memory`` backend (the default): records in this process's memory, bounded (tails first)."""

from __future__ import annotations

import torch

from pd_cache.core.config import KVLayout
from pd_cache.storage.local import LocalBackend, Slot
from pd_cache.storage.record import PageRecord


class MemoryBackend(LocalBackend):
    """Keeps a private copy of each record's payloads; lost when the process ends."""

    def __init__(self, layout: KVLayout, capacity_bytes: int, *,
                 algo: str = "xxh3_128") -> None:
        super().__init__(layout, capacity_bytes, algo=algo)
        self._records: dict[Slot, PageRecord] = {}

    def _write(self, slot: Slot, record: PageRecord) -> None:
        # NOTE: a private copy: the caller's buffers (or Ray's read-only views) stay theirs.
        payloads = tuple(t.detach().clone(memory_format=torch.contiguous_format)
                         for t in record.payloads)
        self._records[slot] = PageRecord(record.header, payloads)

    def _read(self, slot: Slot) -> PageRecord | None:
        return self._records.get(slot)

    def _delete(self, slot: Slot) -> None:
        self._records.pop(slot, None)

    def _footprint(self, record: PageRecord) -> int:
        return record.nbytes
