"""Interfaces and result types of the worker-local KV tiers (L1 device, L2 host).

A *page* holds the KV of ``page_size`` consecutive tokens (``KVLayout.page_shape``). Pools
hold pages in fixed slots; the prefix cache indexes them by ``(namespace, tokens)``.

Ownership: every allocated slot has exactly one owner (a request id, or ``"radix"`` for
the pages the prefix cache keeps). Only the owner frees a slot, exactly once; ``close()``
reports any slot still owned. The prefix cache owns the slots of its nodes; a request that
reads cached pages does so under a lock, never by taking their slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from pd_cache.core.hashing import page_hashes, token_buffer
from pd_cache.core.request import Req, compute_prefix_hash
from pd_cache.core.vocab import Tier


class SlotError(RuntimeError):
    """A slot ownership rule was broken: double free, foreign free, or a leak at close.

    These are bugs in the caller, never a cache miss; the message names slot and owner.
    """


class PoolFullError(RuntimeError):
    """A pool has fewer free slots than were asked for."""


class CacheInvariantError(RuntimeError):
    """``check_invariants`` found the prefix cache in an inconsistent state."""


class CacheKey(NamedTuple):
    """What the prefix cache is keyed by: a namespace and tokens, with their page names.

    ``names[i]`` is the namespaced chain hash of page ``i``; it carries the namespace (and
    the whole prefix) into every tree lookup, so a node never needs to store one.
    """

    namespace: tuple[str | None, str | None]
    tokens: tuple[int, ...]
    names: tuple[bytes, ...]
    page_size: int

    @classmethod
    def for_request(cls, req: Req, tokens: Any = None, *, page_size: int,
                    algo: str = "xxh3_128") -> CacheKey:
        """The key of ``tokens`` (default: the prompt) in ``req``'s own namespace."""
        tokens = req.input_ids if tokens is None else tokens
        buf = token_buffer(tokens)   # NOTE: converted and checked once, hashed from there
        names = compute_prefix_hash(req, buf, page_size=page_size, algo=algo)
        return cls(req.namespace, tuple(buf.tolist()), tuple(names), page_size)

    @classmethod
    def build(cls, tokens: Any, *, page_size: int, extra_key: str | None = None,
              cache_salt: str | None = None, algo: str = "xxh3_128") -> CacheKey:
        """The key of ``tokens`` in the namespace ``(extra_key, cache_salt)``."""
        names = page_hashes(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt,
                            algo=algo)
        return cls((extra_key, cache_salt), tuple(token_buffer(tokens).tolist()),
                   tuple(names), page_size)

    @property
    def num_pages(self) -> int:
        """Full pages only; a trailing partial page is never cached."""
        return len(self.names)

    def page_tokens(self, i: int) -> tuple[int, ...]:
        return self.tokens[i * self.page_size:(i + 1) * self.page_size]


class HitPage(NamedTuple):
    """One matched page: its name, the tier it was found in, its slot there, and the
    namespace seed of the request that produced it (``b""``: not recorded)."""

    name: bytes
    tier: Tier
    slot: int
    seed: bytes = b""


class MatchResult(NamedTuple):
    """The longest cached prefix of a key, page by page, and the node it ends at.

    ``node`` is the handle to ``lock``/``unlock``; it is the tree root when nothing hit.
    """

    pages: tuple[HitPage, ...]
    node: Any
    key: CacheKey

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.key.page_size

    def count(self, tier: Tier) -> int:
        """Hit pages that were found in ``tier``."""
        return sum(1 for p in self.pages if p.tier == tier)

    def seeded(self, seed: bytes) -> int:
        """Hit pages before the first one another namespace produced (its stored ``seed``
        is not ``seed``): the prefix the independent audit lets a request use."""
        return next((i for i, p in enumerate(self.pages) if p.seed != seed), len(self.pages))

    @property
    def names_past_hit(self) -> tuple[bytes, ...]:
        """Names of the key's full pages after the hit: what a lower tier may still have."""
        return self.key.names[len(self.pages):]


class InsertResult(NamedTuple):
    """``node``: the deepest node of the key now cached; ``num_new``: pages added;
    ``num_pages``: pages of the key cached after the call (``<= key.num_pages`` when the
    device pool could not make room for all)."""

    node: Any
    num_new: int
    num_pages: int


class PrefixCache(ABC):
    """A prefix index over a device pool (L1) and a host pool (L2).

    Single-threaded: a worker calls it from its one scheduling loop.
    """

    @abstractmethod
    def match_prefix(self, key: CacheKey, max_pages: int | None = None) -> MatchResult:
        """The longest cached prefix of ``key`` (at most ``max_pages`` pages), by tier.

        Changes nothing but access times (the matched path becomes most recently used).
        The result is valid until the next call that may evict; ``lock(result.node)``
        first to keep its pages.
        """

    @abstractmethod
    def load_back(self, match: MatchResult, pages: torch.Tensor | None = None) -> MatchResult:
        """Copy the host-only pages of ``match`` to device, and return the updated match.

        Evicts other unlocked device pages as needed; if the device pool cannot make room
        for all, a leading part is loaded and the rest stays on host (still readable).
        ``pages`` (optional): the match's pages as ``read_pages`` just returned them (the
        caller holds a lock since); the device copies are then made from there instead of
        being read from the host pool again. Raises ``ValueError`` if ``match.node`` has
        been evicted since (a stale match), or if ``pages`` is not one page per match page.
        """

    @abstractmethod
    def read_pages(self, match: MatchResult, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the matched pages, ``[match.num_pages, *page_shape]``, in key order.

        ``out`` (optional): a contiguous page tensor of that shape on the device pool's
        device to copy them into (and return), e.g. the head of a request's page tensor;
        ``ValueError`` if its shape or dtype is wrong.
        """

    @abstractmethod
    def prefix_of(self, match: MatchResult, num_pages: int) -> MatchResult:
        """The first ``num_pages`` pages of ``match`` (ending at their own node)."""

    @abstractmethod
    def resume_pages(self, match: MatchResult) -> int:
        """How many pages of ``match`` a request can resume from: all of them for a plain
        model; for a hybrid one, up to its deepest page that keeps a recurrent state."""

    @abstractmethod
    def read_state(self, match: MatchResult, num_pages: int) -> torch.Tensor:
        """A copy of the recurrent state after page ``num_pages - 1`` of ``match``; raises
        ``ValueError`` if that page keeps none."""

    @abstractmethod
    def insert(self, key: CacheKey, pages: torch.Tensor, seed: bytes = b"",
               states: Mapping[int, torch.Tensor] | None = None) -> InsertResult:
        """Cache the full pages of ``key``; ``pages[i]`` is the KV of page ``i``.

        ``seed`` is the namespace seed of the request that computed them, kept with each new
        page so that a reader can check it against its own request's seed (the audit that
        does not trust the lookup). ``states`` (a hybrid model's) maps a page index to the
        recurrent state after that page: each cached page there that keeps none gets it.

        Pages already cached are kept as they are (and loaded back to device if they were
        on host only); new ones get device slots, evicting unlocked pages as needed, and
        under ``write_through`` also a host copy. Insertion stops early, without error, when
        the device pool cannot make room. Raises ``ValueError`` if ``pages`` has the wrong
        shape or dtype (or a state of the wrong shape) or fewer than ``key.num_pages``
        pages; nothing is cached then.
        """

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Pin ``node`` and its ancestors: none of them is evicted until ``unlock``."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Undo one ``lock(node)``. Raises ``ValueError`` if ``node`` holds no lock."""

    @abstractmethod
    def evict(self, tier: Tier, num_pages: int) -> int:
        """Free up to ``num_pages`` slots of ``tier``, least recently used first.

        Device pages move to host (copied unless already there), or are dropped if the
        host has no room; host pages are dropped. Locked nodes are never touched.
        Returns the number of slots freed.
        """

    @abstractmethod
    def clear(self) -> None:
        """Evict every unlocked page from both tiers (locked paths stay)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise ``CacheInvariantError`` unless tree, pools and locks agree."""

    @property
    @abstractmethod
    def num_locks(self) -> int:
        """Outstanding ``lock`` calls not yet undone; zero when no request is running."""


__all__ = [
    "CacheInvariantError", "CacheKey", "HitPage", "InsertResult", "MatchResult",
    "PoolFullError", "PrefixCache", "SlotError",
]
