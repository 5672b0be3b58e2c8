"""Wire types: what crosses between the router, prefill and decode processes.

``PrefillInfo`` travels beside the prompt's KV pages (one tensor, handed over as an
ObjectRef) from prefill to the router and decode; ``DecodeInfo`` comes back from decode;
``WorkerState`` answers a health and leak check; ``Completion`` is what a caller of the
cluster gets; ``PageNames`` is a debug view of one request's names in every process.
None of them holds a tensor, so importing this module loads neither torch nor Ray.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec

from pd_cache.core.vocab import TIERS


class PrefillInfo(msgspec.Struct, frozen=True, gc=False):
    """What prefill tells the router and decode, next to the KV pages.

    ``page_names`` name the prompt's full pages (as the engine used them);
    ``cached_tokens`` counts prompt tokens served by each tier; ``seed`` is the namespace
    seed of the request the KV was computed for (decode compares it with its own);
    ``cross_namespace_pages`` counts cached pages the worker refused because another
    namespace had produced them (recomputed; 0 unless a lookup is wrong). A hybrid
    model's prompt state travels beside the KV as one tensor: the state after each page of
    ``state_pages``, then the state after the prompt's last token. ``kept_pages``: the
    prompt's leading pages the decode worker holds (reserved in its prefix cache): the KV
    handed over starts after them. ``l3_pages``: the prompt's leading pages L3 holds once
    prefill's write lands, as far as prefill knows (``None``: unknown; decode's offload
    then asks).
    """

    rid: str
    worker: int
    first_token: int
    num_prompt_tokens: int
    page_size: int
    page_names: tuple[bytes, ...]
    cached_tokens: dict[str, int]
    seed: bytes
    cross_namespace_pages: int
    compute_s: float
    state_pages: tuple[int, ...] = ()
    kept_pages: int = 0
    l3_pages: int | None = None

    @property
    def cached_pages(self) -> int:
        return sum(self.cached_tokens.values()) // self.page_size

    @property
    def num_kv_pages(self) -> int:
        """The prompt's KV pages (the last one possibly partial)."""
        return -(-self.num_prompt_tokens // self.page_size)

    @property
    def sent_pages(self) -> int:
        """Pages handed to decode: those after ``kept_pages``."""
        return self.num_kv_pages - self.kept_pages


class DecodeInfo(msgspec.Struct, frozen=True, gc=False):
    """A finished decode: the generated tokens and what moved.

    ``cross_namespace_pages``: handed-off pages refused because they were computed for
    another namespace (decode recomputed the prompt instead; 0 unless routing is wrong).
    ``pages_kept``: the prompt's pages decode supplied itself (its prefix cache, or a lost
    reservation's gap filled from L3 or by recompute) instead of receiving them.
    """

    rid: str
    worker: int
    output_ids: list[int]
    pages_received: int
    cross_namespace_pages: int
    handoff_s: float
    decode_s: float
    pages_kept: int = 0


class WorkerState(NamedTuple):
    """Between requests: locks 0, every pool slot owned by the cache (``radix``), and no
    request in a decode worker's hands (``requests``: the rids it decodes or has queued)."""

    worker: int
    role: str
    locks: int
    pool_usage: dict[str, dict[str, int]]
    requests: tuple[str, ...] = ()


class Completion(NamedTuple):
    """One finished request as the caller sees it.

    ``cross_namespace_tokens``: tokens of cached or handed-off pages that a reader refused
    because another namespace had produced them (each reader compares the producer's
    namespace seed, stored with every page, with its own request's; must be 0).
    ``attempts``: 1, or 2 when a worker died under the request and it ran again elsewhere.
    """

    rid: str
    output_ids: list[int]
    num_prompt_tokens: int
    cached_tokens: dict[str, int]
    prefill_worker: int
    decode_worker: int
    ttft_s: float
    latency_s: float
    pages_handed_off: int
    cross_namespace_tokens: int
    attempts: int = 1
    prefill_s: float = 0.0   # the prefill worker's own time (match, L3, compute)
    handoff_s: float = 0.0   # decode fetching the prompt's KV pages
    decode_s: float = 0.0    # decode, batched with the other requests in flight
    pages_kept: int = 0      # prompt pages the decode worker already held (not handed off)


class PageNames(NamedTuple):
    """A request's prompt page names as each process computes them (a debug view)."""

    router: list[bytes]
    prefill: list[list[bytes]]
    decode: list[list[bytes]]
    storage: list[list[bytes]]


class TenantPins(NamedTuple):
    """A tenant's pinned pages across the cluster, each page counted once whatever worker
    or shard holds it: names (hex, sorted), their KV bytes (``pages * page_nbytes``), the
    seconds until the last pin lapses, and pins held by the workers' and the shards'."""

    names: list[str]
    nbytes: int
    expires_in_s: float
    on_workers: int
    on_storage: int

    def body(self, tenant: str) -> dict[str, Any]:
        """The admin route's JSON answer."""
        return {"tenant": tenant, "pages": len(self.names), "bytes": self.nbytes,
                "expires_in_s": round(self.expires_in_s, 3), "names": self.names,
                "on_workers": self.on_workers, "on_storage": self.on_storage}


def totals(completions: Iterable[Completion]) -> dict[str, Any]:
    """Sums over completions: cached tokens by tier, pages handed off, cross-namespace."""
    out: dict[str, Any] = {"requests": 0, "prompt_tokens": 0,
                           "cached_tokens": dict.fromkeys(TIERS, 0),
                           "pages_handed_off": 0, "cross_namespace_tokens": 0}
    for c in completions:
        out["requests"] += 1
        out["prompt_tokens"] += c.num_prompt_tokens
        for tier, n in c.cached_tokens.items():
            out["cached_tokens"][tier] = out["cached_tokens"].get(tier, 0) + n
        out["pages_handed_off"] += c.pages_handed_off
        out["cross_namespace_tokens"] += c.cross_namespace_tokens
    return out
