"""Pinned prefixes of the radix tree: pages no eviction takes until their pin lapses.

A request that asks for it (``Req.pin_ttl_s``) pins the nodes of its prompt's path, from
the root down, so a pinned prefix is always a usable one. The tree's ``Pins`` hold them
(``pd_cache.core.pins``); eviction parks a pinned node as it parks a locked one, and takes
it back once its pin lapses. A hit (``match_prefix``, ``insert``) renews the pins of the
path it touches.

No more than ``max_pinned_fraction`` of either pool is pinned: a pin that would pass it
pins the leading pages that fit, and the rest of its path stays an ordinary cached page.
"""

from __future__ import annotations

from typing import NamedTuple

from pd_cache.core.pins import pinned_page_limit
from pd_cache.kv.evict import Evicting
from pd_cache.kv.node import Node


class PinnedPage(NamedTuple):
    """One pinned page: its name, whose pin it is, and seconds until the pin lapses."""

    name: bytes
    owner: str
    expires_in_s: float


class Pinning(Evicting):
    """What ``RadixCache`` pins with: its pools and its ``Pins``."""

    max_pinned_fraction: float

    @property
    def max_pinned_pages(self) -> int:
        """The most pages pinned at once: the fraction of the smaller (non-empty) pool."""
        return pinned_page_limit(self.max_pinned_fraction, self.device.capacity,
                                 self.host.capacity)

    def pin(self, node: Node, ttl_s: float, owner: str = "", max_pages: int | None = None
            ) -> int:
        """Pin ``node``'s path (its first ``max_pages`` pages) for ``ttl_s`` seconds,
        renewed by each hit, as many pages, from the first, as the fraction allows; how
        many of them are pinned now."""
        self._lapse()
        room = self.max_pinned_pages - len(self.pins)
        done = 0
        for n in node.path()[:max_pages]:
            if n not in self.pins:
                if room <= 0:
                    break
                room -= 1
            self.pins.pin(n, ttl_s, owner)
            done += 1
        return done

    def pinned(self, owner: str | None = None) -> list[PinnedPage]:
        """Every page pinned now (by ``owner``, when given)."""
        now = self.pins.clock()
        return [PinnedPage(n.name, p.owner, p.until - now) for n, p in self.pins.items()
                if owner is None or p.owner == owner]

    def drop_pins(self, owner: str | None = None) -> int:
        """Unpin every page of ``owner`` (default: all); the pages stay cached, evictable
        again. How many pins went."""
        gone = [n for n, p in self.pins.items() if owner is None or p.owner == owner]
        for n in gone:
            self.pins.drop(n)
            self._unpinned(n)
        return len(gone)

    def clear(self) -> None:
        self.drop_pins()   # NOTE: an operator's reset drops the pins too (drop_caches)
        super().clear()
