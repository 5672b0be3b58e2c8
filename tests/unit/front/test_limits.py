"""Rate limits per key (token buckets on a test clock) and usage per tenant (the ingress's
guard, recording through a real prometheus registry)."""

from __future__ import annotations

import pytest

from pd_cache.core.wire import Completion
from pd_cache.front.guard import TenantGuard
from pd_cache.front.http import HTTPError
from pd_cache.front.keyfile import KeyRate, Tenant
from pd_cache.front.limits import RateLimiter, TokenBucket, duration, retry_headers
from pd_cache.front.tenants import Tenants
from pd_cache.metrics import PDCacheMetrics
from tests.unit.clock import Clock


def test_a_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    bucket = TokenBucket(10, 2, now=0)
    assert bucket.wait_s(10, 0) == 0
    bucket.take(10)
    assert bucket.wait_s(1, 0) == 0.5 and bucket.wait_s(4, 0) == 2.0
    assert bucket.refill(1.5) == 3 and bucket.reset_s(1.5) == 3.5
    assert bucket.refill(1.0) == 3            # time never runs backwards
    assert bucket.refill(100) == 10           # never above capacity
    # an oversize cost passes on a full bucket and leaves it in debt
    assert bucket.wait_s(25, 100) == 0
    bucket.take(25)
    assert bucket.level == -15 and bucket.wait_s(1, 100) == 8.0
    with pytest.raises(ValueError):
        TokenBucket(0, 1, now=0)


def test_requests_per_s_refuses_over_the_rate_and_says_when_to_retry() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rate = KeyRate(requests_per_s=2)
    assert limiter.admit("k1", rate, 10) is None
    assert limiter.admit("k1", rate, 10) is None          # a burst of one second's worth
    refused = limiter.admit("k1", rate, 10)
    assert refused is not None and refused.retry_after_s == 0.5
    assert "requests" in refused.message
    assert refused.headers == {"x-ratelimit-limit-requests": "2",
                               "x-ratelimit-remaining-requests": "0",
                               "x-ratelimit-reset-requests": "1s"}
    assert limiter.admit("k2", rate, 10) is None          # another key: its own bucket
    assert limiter.admit("k0", KeyRate(), 10**9) is None  # unlimited
    clock.now += 0.5
    assert limiter.admit("k1", rate, 10) is None
    assert limiter.admit("k1", rate, 10) is not None      # a refusal took nothing...
    clock.now += 0.5
    assert limiter.admit("k1", rate, 10) is None          # ...so half a second refills one


def test_tokens_per_min_counts_prompt_and_output_and_refuses_the_impossible() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rate = KeyRate(requests_per_s=100, tokens_per_min=600)   # 10 tokens per second
    assert limiter.admit("k", rate, 550) is None
    refused = limiter.admit("k", rate, 100)
    assert refused is not None and refused.retry_after_s == pytest.approx(5.0)
    assert "tokens" in refused.message
    assert refused.headers["x-ratelimit-remaining-tokens"] == "50"
    assert refused.headers["x-ratelimit-reset-tokens"] == "55s"
    assert refused.headers["x-ratelimit-remaining-requests"] == "99"   # nothing taken
    too_big = limiter.admit("k", rate, 601)
    assert too_big is not None and too_big.retry_after_s is None
    assert "601 tokens" in too_big.message and "600 tokens per minute" in too_big.message


def test_replicas_split_each_keys_limits_evenly() -> None:
    clock = Clock()
    limiter = RateLimiter(replicas=4, clock=clock)
    rate = KeyRate(requests_per_s=2, tokens_per_min=400)   # per replica: 0.5 req/s, 100 tok
    assert limiter.admit("k", rate, 150) is None           # too big for a share, bucket full
    refused = limiter.admit("k", rate, 1)    # 51 tokens short, at 100/60 per second
    assert refused is not None and refused.retry_after_s == pytest.approx(51 * 0.6)
    assert refused.headers["x-ratelimit-limit-requests"] == "1"   # at least one request
    assert refused.headers["x-ratelimit-limit-tokens"] == "100"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.now += 30.6
    assert limiter.admit("k", rate, 1) is None
    with pytest.raises(ValueError):
        RateLimiter(replicas=0)


@pytest.mark.parametrize("seconds, text", [(0.0201, "21ms"), (0.5, "500ms"), (1, "1s"),
                                           (1.5, "1.5s"), (360, "6m0s"), (90.25, "1m30.25s")])
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    assert retry_headers(0.01) == {"Retry-After": "1", "retry-after-ms": "10"}
    assert retry_headers(2.2) == {"Retry-After": "3", "retry-after-ms": "2200"}


def completion(prompt: int, cached: int, generated: int) -> Completion:
    return Completion("r", [7] * generated, prompt, {"device": cached, "host": 0,
                                                     "storage": 0}, 0, 0, 0.1, 0.2, 1, 0)


def test_the_guard_refuses_with_429_and_counts_usage_by_tenant(tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('{"keys": {"sk-slow-0001": {"tenant": "slow", "requests_per_s": 0.1},'
                    ' "sk-fast-0002": "fast"}}')
    tenants = Tenants.from_file(keys)
    metrics = PDCacheMetrics("prometheus", tenants=tenants.names)
    clock = Clock()
    guard = TenantGuard(tenants, metrics=metrics, clock=clock)
    slow, fast = tenants.tenant("Bearer sk-slow-0001"), tenants.tenant("Bearer sk-fast-0002")
    guard.admit(slow, 40)
    with pytest.raises(HTTPError) as refused:
        guard.admit(slow, 40)
    err = refused.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.body()["error"]["type"] == "rate_limit_error"
    assert err.headers["Retry-After"] == "10" and err.headers["retry-after-ms"] == "10000"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    for _ in range(5):
        guard.admit(fast, 40)                     # no limits: never refused
    guard.served(slow, completion(30, 16, 10))
    guard.served(fast, completion(20, 0, 4))
    guard.served(fast, completion(20, 12, 4))
    value = lambda name, **labels: metrics.registry.get_sample_value(name, labels)  # noqa: E731
    assert value("pd_cache_tenant_rate_limited_total", tenant="slow") == 1
    assert value("pd_cache_tenant_rate_limited_total", tenant="fast") is None
    assert value("pd_cache_tenant_tokens_total", tenant="slow", token_kind="prompt") == 30
    assert value("pd_cache_tenant_tokens_total", tenant="fast", token_kind="generated") == 8
    assert value("pd_cache_tenant_cached_tokens_total", tenant="slow") == 16
    assert value("pd_cache_tenant_cached_tokens_total", tenant="fast") == 12
    # a tenant label holds the key file's names only: a client's salt is refused
    with pytest.raises(ValueError, match="tenant='team-1'"):
        metrics.count_tenant_cached_tokens("team-1", 1)
    with pytest.raises(ValueError, match="tenant"):
        PDCacheMetrics("prometheus").count_rate_limited("slow")   # open mode: no tenants


def test_open_mode_has_no_limits_and_records_nothing() -> None:
    guard = TenantGuard(None)
    assert guard.metrics is None
    open_tenant = Tenant("", admin=True)
    for _ in range(3):
        guard.admit(open_tenant, 10**6)
    guard.served(open_tenant, completion(5, 0, 1))
