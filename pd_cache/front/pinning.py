"""Pinned prefixes at the ingress: a pin's limits, checked before any work, and the admin
routes that list and drop a tenant's pins.

A request that pins (``Req.pin_ttl_s``; the body's ``pd_cache.pin_ttl_s`` or
``prompt_cache_retention``) is refused with a 400 naming the limit it would pass:

- ``max_pinned_fraction`` (cache config): its prompt has more full pages than a worker may
  hold pinned, that fraction of its device pool plus that of its host pool (a pinned page
  is held in one of them, ``pd_cache.kv.pinning``), so no worker could keep it (checked
  from the config, no call);
- ``max_pinned_bytes`` (the tenant's, key file): the tenant's pinned pages after this pin,
  each page once whatever workers and shards hold it (``PDCluster.pins``: one call to every
  worker and shard, made only for requests that pin), times the KV bytes of a page.

The tenant limit is one cluster-wide count, the same for every ingress replica, not a
share per replica or per shard. Two pinning requests of one tenant admitted at once may
both pass before either lands, so it can be passed by what is in flight. What each pool
or shard actually pins stays within its own ``max_pinned_fraction``: past it, pages are
cached unpinned (``pd_cache.kv.pinning``, ``pd_cache.storage.pinned``).

::

    GET  /admin/tenants/{tenant}/pins        the tenant's pins: pages, bytes, expiry, names
    POST /admin/tenants/{tenant}/pins/drop   unpin them (the pages stay cached)
"""

from __future__ import annotations

import asyncio
from typing import Any

from pd_cache.core.pins import pinned_page_limit
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.front.http import HTTPError
from pd_cache.front.keyfile import Tenant
from pd_cache.front.tenants import Tenants
from pd_cache.metrics import PDCacheMetrics


class PinGate:
    """The pin limits of one ingress replica over ``cluster`` (a ``PDCluster``)."""

    def __init__(self, cluster: Any, tenants: Tenants | None,
                 metrics: PDCacheMetrics | None) -> None:
        self.cluster, self.tenants, self.metrics = cluster, tenants, metrics
        cache = cluster.pd.cache
        self.page_size, self.algo = cache.page_size, cache.hash_algo
        self.max_pages = pinned_page_limit(cache.max_pinned_fraction, cache.device_pages,
                                           cache.host_pages)
        self.fraction = cache.max_pinned_fraction

    async def admit(self, tenant: Tenant, req: Req) -> None:
        """``HTTPError`` 400 if ``req``'s pin would pass a limit; nothing if it pins none."""
        if not req.pin_ttl_s:
            return
        pages = len(req.input_ids) // self.page_size
        if pages > self.max_pages:
            raise HTTPError(400, f"pin: the prompt's {pages} full pages exceed "
                                 f"max_pinned_fraction={self.fraction} of a worker's "
                                 f"device and host pools ({self.max_pages} pages)",
                            "max_pinned_fraction", "pin_limit_exceeded")
        limit = self._limit(tenant)
        if limit is None:
            return
        held = await asyncio.to_thread(self.cluster.pins, tenant.name)
        mine = compute_prefix_hash(req, req.input_ids, page_size=self.page_size, algo=self.algo)
        total = len(set(held.names) | {n.hex() for n in mine}) * self.cluster.pd.layout.page_nbytes
        self._gauge(tenant.name, held.nbytes)
        if total > limit:
            raise HTTPError(400, f"pin: tenant {tenant.name!r} would hold {total} pinned bytes "
                                 f"(now {held.nbytes}), over its max_pinned_bytes={limit}",
                            "max_pinned_bytes", "pin_limit_exceeded")

    async def call(self, action: str, tenant: str) -> dict[str, Any]:
        """The admin route ``action`` (``pins`` | ``drop_pins``) for ``tenant``."""
        if action == "pins":
            held = await asyncio.to_thread(self.cluster.pins, tenant)
            self._gauge(tenant, held.nbytes)
            return held.body(tenant)
        dropped = await asyncio.to_thread(self.cluster.drop_pins, tenant)
        self._gauge(tenant, 0)
        return {"tenant": tenant, "dropped_pins": dropped}

    def _limit(self, tenant: Tenant) -> int | None:
        if self.tenants is None or tenant.name not in self.tenants.limits:
            return None
        return self.tenants.limits[tenant.name].max_pinned_bytes

    def _gauge(self, tenant: str, nbytes: int) -> None:
        if self.metrics is not None and self.tenants is not None \
                and tenant in self.tenants.names:
            self.metrics.set_tenant_pinned_bytes(tenant, nbytes)
