"""Page pools: one tensor ``[capacity, *page_shape]`` plus an owner-tracking allocator.

The device pool (L1) lives on the worker's torch device; the host pool (L2) in CPU memory,
pinned when CUDA is present so host <-> device copies can overlap compute. ``SlotPool`` is
what every pool shares (``pd_cache.kv.state`` keeps recurrent states in one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pd_cache.core.config import KVLayout
from pd_cache.kv.allocator import SlotAllocator
from pd_cache.kv.pages import check_pages, kv_torch_dtype


class SlotPool:
    """Fixed-capacity storage of equal tensors; slots are allocated and freed with an owner."""

    def __init__(self, name: str, capacity: int, layout: KVLayout, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 pin_memory: bool = False) -> None:
        self.name = name
        self.layout = layout
        self.allocator = SlotAllocator(capacity, name)
        self.data = torch.zeros((capacity, *shape), dtype=dtype, device=device,
                                pin_memory=pin_memory)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def device(self) -> torch.device:
        return self.data.device

    def alloc(self, n: int, owner: str) -> list[int]:
        return self.allocator.alloc(n, owner)

    def free(self, slots: Sequence[int], owner: str) -> None:
        self.allocator.free(slots, owner)

    def usage(self) -> dict[str, int]:
        return self.allocator.usage()

    def close(self) -> None:
        self.allocator.close()

    def read(self, slots: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of what ``slots`` hold, ``[len(slots), *shape]``; into ``out`` (a
        contiguous tensor of that shape and dtype on this pool's device) when given."""
        # NOTE: index_select, not ``data[index]``: advanced indexing is ~5x slower on CPU.
        index = _index(slots, self.device)
        if out is None:
            return self.data.index_select(0, index)
        return torch.index_select(self.data, 0, index, out=out)


class PagePool(SlotPool):
    """Fixed-capacity page storage; slots are allocated and freed with an owner."""

    def __init__(self, name: str, capacity: int, layout: KVLayout,
                 device: torch.device | str = "cpu", *, pin_memory: bool = False) -> None:
        super().__init__(name, capacity, layout, layout.page_shape,
                         kv_torch_dtype(layout.kv_dtype), device, pin_memory=pin_memory)

    def write(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        """Store ``pages`` ``[len(slots), *page_shape]`` into ``slots``."""
        check_pages(pages, self.layout, field=f"{self.name}.write: pages", num_pages=len(slots))
        if slots:
            self.data.index_copy_(0, _index(slots, self.device),
                                  pages.to(self.device, non_blocking=True))

    def rows(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """Views of ``slots``' pages (``[*page_shape]`` each), to write pages in place."""
        return [self.data[slot] for slot in slots]

    def copy_to(self, dst: PagePool, src_slots: Sequence[int], dst_slots: Sequence[int]) -> None:
        """Copy pages ``src_slots`` of this pool into ``dst_slots`` of ``dst``."""
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{self.name}.copy_to: {len(src_slots)} source slots but "
                             f"{len(dst_slots)} destination slots")
        if src_slots:
            dst.data.index_copy_(0, _index(dst_slots, dst.device),
                                 self.read(src_slots).to(dst.device))


def _index(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(slots), dtype=torch.long, device=device)


def device_pool(layout: KVLayout, capacity: int,
                device: torch.device | str = "cpu") -> PagePool:
    """The L1 pool on the worker's compute device."""
    return PagePool("device", capacity, layout, device)


def host_pool(layout: KVLayout, capacity: int) -> PagePool:
    """The L2 pool in CPU memory (pinned when a CUDA device will read it)."""
    return PagePool("host", capacity, layout, "cpu", pin_memory=torch.cuda.is_available())
