"""The cluster's L3 keys (``pd_cache.core.sealing``): rotation, retirement, a tenant's purge.

The cluster holds the key state its workers agree on and pushes every change to all of
them. A purge forgets a tenant::

    1. workers finish their pending L3 writes (sealed under the keys so far)
    2. the tenant's epoch moves on: every record it had is unreadable at once (a miss)
    3. each worker drops the tenant's pages from its L1 and L2 (locked pages stay)
    4. each shard deletes the tenant's records (by owner label), in the background

A retirement does 1, 2 for every older key version, and 4 for their records.

Quotas (``set_quotas``) reach the shards the same way, by owner label: a tenant's L3 quota
is split evenly, each shard holding at most ``quota // shards`` of its bytes (pages spread
over shards by name, so a tenant fills its shares about evenly).

Each new key state is saved (``pd_cache.worker.key_state``) before the workers get it: a
worker that restarts reads it as it starts, and a cluster attached by name starts from it.
Quotas are not saved: a restarted shard has none until ``set_quotas`` runs again (the
server pushes them every metrics interval).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pd_cache.core.sealing import KeyState
from pd_cache.worker import key_state


class Reclaim(NamedTuple):
    """What a purge or a retirement did at once, and the deletion it left running."""

    pages: int            # L1 and L2 pages the workers dropped (a purge)
    pending: list[Any]    # the shards' ``reclaim`` calls: records deleted, in the background

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the shards; how many records they deleted."""
        import ray

        return sum(ray.get(self.pending, timeout=timeout))


class ClusterKeys:
    """Key operations of a ``PDCluster`` (mixed in through ``ClusterOperations``)."""

    keys: KeyState = KeyState()
    _owners: dict[str, bytes]   # tenant -> owner label, learnt from a worker once
    keys_name: str | None = None   # where the state is saved (None: nowhere)
    prefill: list[Any]
    decode: list[Any]
    storage: list[Any]

    def flush(self) -> None:
        raise NotImplementedError

    def set_keys(self, state: KeyState) -> KeyState:
        """Give every worker ``state`` (and keep it here)."""
        import ray

        if self.keys_name:
            key_state.save(self.keys_name, state)
        ray.get([a.set_keys.remote(state) for a in self.prefill + self.decode])
        self.keys = state
        return state

    def rotate_keys(self) -> KeyState:
        """Start a new key version for new writes; older ones stay readable until retired."""
        return self.set_keys(self.keys.rotated())

    def retire_keys(self) -> Reclaim:
        """Retire every key version but the current one: their records are misses at once
        and the shards delete them in the background."""
        self.flush()
        state = self.set_keys(self.keys.retired())
        return Reclaim(0, [s.reclaim.remote([], state.oldest) for s in self.storage])

    def purge_tenant(self, tenant: str) -> Reclaim:
        """Forget ``tenant``'s cache in every tier (see the module docstring)."""
        import ray

        if not isinstance(tenant, str):
            raise ValueError(f"tenant: expected a str, got {type(tenant).__name__}")
        workers = self.prefill + self.decode
        self.flush()
        self.set_keys(self.keys.purged(tenant))
        pages = sum(ray.get([a.forget_tenant.remote(tenant) for a in workers]))
        owners = list(self.owners([tenant]).values())
        return Reclaim(pages, [s.reclaim.remote(owners, 0) for s in self.storage])

    def owners(self, tenants: Iterable[str]) -> dict[str, bytes]:
        """Each tenant's owner label on sealed records, as the workers' keyring derives it
        (a shard knows tenants by it only); none without workers."""
        import ray

        todo = [t for t in dict.fromkeys(tenants) if t not in self._owners]
        if todo and self.prefill + self.decode:
            worker = (self.prefill + self.decode)[0]
            self._owners.update(zip(todo, ray.get([worker.owner.remote(t) for t in todo])))
        return {t: self._owners[t] for t in tenants if t in self._owners}

    def set_quotas(self, quotas: Mapping[str, int]) -> None:
        """Each tenant's L3 quota in bytes, over every shard (see the module docstring); a
        tenant left out has none and shares what the quotas leave. Replaces the last call's."""
        import ray

        for tenant, quota in quotas.items():
            if not isinstance(tenant, str) or isinstance(quota, bool) \
                    or not isinstance(quota, int) or quota < 0:
                raise ValueError(f"quotas[{tenant!r}]: expected a tenant name and an int "
                                 f">= 0, got {quota!r}")
        shards = max(1, len(self.storage))
        owners = self.owners(quotas)
        share = {owners[t]: q // shards for t, q in quotas.items() if t in owners}
        ray.get([s.set_quotas.remote(share) for s in self.storage])

    def tenant_l3_bytes(self, tenants: Iterable[str]) -> dict[str, int]:
        """L3 bytes each of ``tenants`` holds now, summed over the shards."""
        import ray

        owners = self.owners(tenants)
        held = ray.get([s.owner_bytes.remote() for s in self.storage])
        return {t: sum(h.get(o, 0) for h in held) for t, o in owners.items()}
