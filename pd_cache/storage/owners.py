"""What a shard does by owner label: a purged tenant's records, quotas, bytes held.

Sealed records carry their tenant's opaque owner label (``pd_cache.core.sealing``); a shard
never learns a tenant's name. Quotas arrive keyed by owner label, in bytes for this shard
(``PDCluster.set_quotas`` gives each shard its share, quota // shards); the order pages go
in is :class:`~pd_cache.storage.eviction.Shares`'.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Mapping
from typing import Any

from pd_cache.core.stats import Stats
from pd_cache.core.vocab import Event, MissReason
from pd_cache.storage.eviction import Shares, Slot


class OwnerShares:
    """Mixed into ``LocalBackend``: its calls by owner label."""

    _lock: threading.RLock
    _index: dict[Slot, Any]
    _policy: Shares
    _stats: Stats

    def _remove(self, slot: Slot) -> None:
        raise NotImplementedError

    def _evict(self, slot: Slot) -> None:
        raise NotImplementedError

    def _ghost(self, slot: Slot, reason: MissReason) -> None:
        raise NotImplementedError

    def reclaim(self, owners: Container[bytes] = (), below: int = 0) -> int:
        """Delete every sealed record of one of ``owners`` (purged tenants) or sealed under
        a key version below ``below`` (retired); how many. Not eviction: not counted."""
        with self._lock:
            gone = [slot for slot, e in self._index.items() if e.header.seal is not None
                    and (e.header.seal.owner in owners or e.header.seal.version < below)]
            for slot in gone:
                self._remove(slot)
        return len(gone)

    def set_quotas(self, quotas: Mapping[bytes, int]) -> None:
        """Bytes each owner label may hold here (absent: no quota); an owner over its new
        quota loses its tails at once."""
        with self._lock:
            self._policy.quotas = dict(quotas)
            while (slot := self._policy.excess()) is not None:
                self._evict(slot)

    def owner_bytes(self) -> dict[bytes, int]:
        """Bytes held per owner label (sealed records only)."""
        with self._lock:
            return {o: n for o, n in self._policy.owned.items() if o is not None and n}

    def _fit_quota(self, slot: Slot) -> bool:
        """Evict tails of ``slot``'s owner while it is over its quota; ``False`` (the page
        refused, counted ``refused/quota``) when the page itself would be the one to go."""
        owner = self._policy.owner(slot)
        while self._policy.over(owner):
            victim = self._policy.excess(owner)
            if victim is None or victim == slot:
                self._remove(slot)
                self._ghost(slot, MissReason.QUOTA)
                self._stats.count(Event.REFUSED, MissReason.QUOTA)
                return False
            self._evict(victim)
        return True
