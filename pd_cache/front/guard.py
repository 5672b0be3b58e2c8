"""The ingress's tenant controls: each key's rate limits, each tenant's usage.

``TenantGuard.admit`` runs once per request, before it reaches the cluster: over its key's
rate (``pd_cache.front.limits``) the request is refused with a 429 in OpenAI's shape, with
``Retry-After`` (and ``retry-after-ms``) and OpenAI's ``x-ratelimit-*`` headers.
``TenantGuard.served`` counts what a served request used, by tenant. ``TenantL3`` gives
the cluster each tenant's L3 quota (the shards enforce it by owner label) and exports the L3
bytes each tenant holds, at start and every metrics interval (so a restarted shard gets its
quotas back). Tenant labels hold the key file's tenant names only (bounded by the key file);
open mode has no tenants, no limits and no per-tenant metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pd_cache.core.wire import Completion
from pd_cache.front.http import HTTPError
from pd_cache.front.keyfile import Tenant
from pd_cache.front.limits import RateLimiter, retry_headers
from pd_cache.front.tenants import Tenants
from pd_cache.metrics import PDCacheMetrics

log = logging.getLogger(__name__)


class TenantGuard:
    """Rate limits per key and usage per tenant for one ingress replica."""

    def __init__(self, tenants: Tenants | None, replicas: int = 1,
                 metrics: PDCacheMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limiter = RateLimiter(replicas, clock)
        if metrics is None and tenants is not None:
            metrics = PDCacheMetrics("auto", tenants=tenants.names)
        self.metrics = metrics

    def admit(self, tenant: Tenant, tokens: int) -> None:
        """Take one request of ``tokens`` (prompt + max output) from the key's buckets;
        ``HTTPError`` 429 when over its rate (retry later) or larger than its limit."""
        refusal = self.limiter.admit(tenant.key_id, tenant.rate, tokens)
        if refusal is None:
            return
        if self.metrics is not None:
            self.metrics.count_rate_limited(tenant.name)
        if refusal.retry_after_s is None:   # never passes: waiting would not help
            raise HTTPError(429, refusal.message, "max_tokens", "request_too_large",
                            refusal.headers)
        raise HTTPError(429, refusal.message, None, "rate_limit_exceeded",
                        refusal.headers | retry_headers(refusal.retry_after_s))

    def served(self, tenant: Tenant, out: Completion) -> None:
        """Count a served request's prompt, cached and generated tokens for its tenant."""
        if self.metrics is None or not tenant.name:
            return
        self.metrics.count_tenant_tokens(tenant.name, "prompt", out.num_prompt_tokens)
        self.metrics.count_tenant_tokens(tenant.name, "generated", len(out.output_ids))
        self.metrics.count_tenant_cached_tokens(tenant.name, sum(out.cached_tokens.values()))


class TenantL3:
    """The key file's L3 quotas pushed to ``cluster``, and each tenant's L3 bytes exported."""

    def __init__(self, cluster: Any, tenants: Tenants, metrics: PDCacheMetrics,
                 interval_s: float) -> None:
        self.cluster, self.names, self.metrics = cluster, tenants.names, metrics
        self.quotas = {name: limits.l3_quota_bytes for name, limits in tenants.limits.items()
                       if limits.l3_quota_bytes is not None}
        self.interval_s = interval_s
        self._stop = threading.Event()

    def sync(self) -> dict[str, int]:
        """Push the quotas; export and return the L3 bytes each tenant holds."""
        if self.quotas:
            self.cluster.set_quotas(self.quotas)
        held = self.cluster.tenant_l3_bytes(self.names)
        for name, nbytes in held.items():
            self.metrics.set_tenant_l3_bytes(name, nbytes)
        return held

    def start(self) -> TenantL3:
        """``sync`` now (a bad quota stops the server here), then every ``interval_s``."""
        self.sync()
        threading.Thread(target=self._loop, name="pd-cache-tenant-l3", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - usage metrics never take the ingress down
                log.exception("tenant L3 quotas and usage not synced")
