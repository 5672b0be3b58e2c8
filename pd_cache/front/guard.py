"""The ingress's tenant controls: each key's rate limits, each tenant's usage.

``TenantGuard.admit`` runs once per request, before it reaches the cluster: over its key's
rate (``pd_cache.front.limits``) the request is refused with a 429 in OpenAI's shape, with
``Retry-After`` (and ``retry-after-ms``) and OpenAI's ``x-ratelimit-*`` headers.
``TenantGuard.served`` counts what a served request used, by tenant. Tenant labels hold the
key file's tenant names only (bounded by the key file); open mode has no tenants, no limits
and no per-tenant metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pd_cache.core.wire import Completion
from pd_cache.front.http import HTTPError
from pd_cache.front.keyfile import Tenant
from pd_cache.front.limits import RateLimiter, retry_headers
from pd_cache.front.tenants import Tenants
from pd_cache.metrics import PDCacheMetrics


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
