"""Pinned prefixes of the radix tree: pages no eviction takes until their pin lapses.

A request that asks for it (``Req.pin_ttl_s``) pins the nodes of its prompt's path, from
the root down, so a pinned prefix is always a usable one. The tree's ``Pins`` hold them
(``pd_cache.core.pins``); eviction parks a pinned node as it parks a locked one, and takes
it back once its pin lapses. A hit (``match_prefix``, ``insert``) renews the pins of the
path it touches.

A pinned page is held in one tier of the worker, and no pool holds more than
``max_pinned_fraction`` of its pages pinned, so a worker pins up to that fraction of its
device and host pages together (``pinned_page_limit``)::

    path      p0 p1 p2 | p3 p4 p5 p6      a pin of 7 pages, host room for 4
    held on   device   | host            device: the leading 3 (their host copies may go)
                                         host:   the rest (their device copies may go)

A page held on host gets a host copy when it has none. The pages held on device are a
prefix of the path (so device residency, prefix-closed, keeps nothing else there for them),
and only as many as the host has no room for. A pin that would pass both bounds pins the
leading pages that fit; the rest of its path stays an ordinary cached page.
"""

from __future__ import annotations

from typing import NamedTuple

from pd_cache.core.pins import pinned_page_limit
from pd_cache.core.vocab import Tier
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
        """The most pages pinned at once: the fraction of each pool, summed."""
        return pinned_page_limit(self.max_pinned_fraction, self.device.capacity,
                                 self.host.capacity)

    def pin(self, node: Node, ttl_s: float, owner: str = "", max_pages: int | None = None
            ) -> int:
        """Pin ``node``'s path (its first ``max_pages`` pages) for ``ttl_s`` seconds,
        renewed by each hit, as many pages, from the first, as the fraction allows; how
        many of them are pinned now."""
        self._lapse()
        path = node.path()[:max_pages]
        if not path:
            return 0
        room = self._pin_room()
        lead = max(0, sum(1 for n in path if n not in self.pins) - room[Tier.HOST])
        done = 0
        self.lock(node)   # NOTE: a host copy made below evicts nothing of this path
        try:
            for n in path:
                if n not in self.pins:
                    tier = self._place(n, room, want_device=lead > 0)
                    if tier is None:
                        break
                    room[tier] -= 1
                    lead -= 1
                self.pins.pin(n, ttl_s, owner)
                done += 1
        finally:
            self.unlock(node)
        return done

    def _pin_room(self) -> dict[Tier, int]:
        """How many more pages each pool may hold pinned."""
        f, held_on_device = self.max_pinned_fraction, len(self._device_pins)
        return {Tier.DEVICE: int(f * self.device.capacity) - held_on_device,
                Tier.HOST: int(f * self.host.capacity) - (len(self.pins) - held_on_device)}

    def _place(self, node: Node, room: dict[Tier, int], want_device: bool) -> Tier | None:
        """The tier that holds ``node``'s new pin (``None``: neither may): the device for a
        leading page the host has no room for, else the host (a host copy made if need be)."""
        on_device = room[Tier.DEVICE] > 0 and node.device_slot is not None and (
            node.parent is None or node.parent.is_root or node.parent in self._device_pins)
        if want_device and on_device:
            self._device_pins.add(node)
            return Tier.DEVICE
        if room[Tier.HOST] > 0 and self._copy_to_host(node):
            return Tier.HOST
        if on_device:
            self._device_pins.add(node)
            return Tier.DEVICE
        return None

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
            self._device_pins.discard(n)
            self._unpinned(n)
        return len(gone)

    def clear(self) -> None:
        self.drop_pins()   # NOTE: an operator's reset drops the pins too (drop_caches)
        super().clear()
