"""Slot allocator and page pools: ownership rules, capacity, copies between tiers."""

from __future__ import annotations

import pytest
import torch

from pd_cache.core.config import KVLayout
from pd_cache.kv import PagePool, PoolFullError, SlotAllocator, SlotError, device_pool, host_pool

LAYOUT = KVLayout(model_id="t", kv_dtype="float32", num_layers=1, page_size=2,
                  num_kv_heads=1, head_dim=2)


def test_alloc_records_owners_and_free_returns_slots() -> None:
    a = SlotAllocator(4, "device")
    r1, r2 = a.alloc(2, "r1"), a.alloc(1, "radix")
    assert len(set(r1 + r2)) == 3 and a.used == 3 and a.num_free == 1
    assert [a.owner_of(s) for s in r1] == ["r1", "r1"] and a.owned_by("radix") == r2
    assert a.usage() == {"r1": 2, "radix": 1}
    a.free(r1, "r1")
    assert a.used == 1 and a.usage() == {"radix": 1}
    again = a.alloc(3, "r3")
    assert set(again) == {0, 1, 2, 3} - set(r2)


def test_full_pool_raises_and_changes_nothing() -> None:
    a = SlotAllocator(3, "host")
    a.alloc(2, "r1")
    with pytest.raises(PoolFullError, match="host: cannot allocate 2 slots for 'r2': 1 of 3"):
        a.alloc(2, "r2")
    assert a.used == 2 and a.usage() == {"r1": 2}
    assert SlotAllocator(0).alloc(0, "x") == []


def test_double_free_names_slot_and_owner() -> None:
    a = SlotAllocator(4, "device")
    s = a.alloc(2, "r1")
    a.free(s[:1], "r1")
    with pytest.raises(SlotError, match=rf"device: slot {s[0]} freed by 'r1' but it is "
                                        r"already free \(double free\)"):
        a.free(s, "r1")
    # the failed call freed nothing, not even the slot that was still held
    assert a.owner_of(s[1]) == "r1"
    with pytest.raises(SlotError, match="double free"):
        a.free([s[1], s[1]], "r1")
    assert a.owner_of(s[1]) == "r1"


def test_free_of_a_slot_not_owned_names_the_owner() -> None:
    a = SlotAllocator(4, "device")
    s = a.alloc(1, "radix")
    with pytest.raises(SlotError, match=rf"device: slot {s[0]} is owned by 'radix'; 'r9' "
                                        r"cannot free it"):
        a.free(s, "r9")
    assert a.owner_of(s[0]) == "radix"
    with pytest.raises(ValueError, match=r"slot 7 is not in \[0, 4\)"):
        a.free([7], "radix")


def test_close_reports_leaks_with_slot_and_owner() -> None:
    a = SlotAllocator(4, "host")
    s1, s2 = a.alloc(1, "r1"), a.alloc(1, "radix")
    with pytest.raises(SlotError, match=rf"host: 2 slots leaked at close: slot {s1[0]} "
                                        rf"\(owner 'r1'\), slot {s2[0]} \(owner 'radix'\)"):
        a.close()
    a.free(s1, "r1")
    a.free(s2, "radix")
    a.close()
    with pytest.raises(SlotError, match="used after close"):
        a.alloc(1, "r1")


def test_transfer_moves_ownership_all_or_nothing() -> None:
    a = SlotAllocator(4)
    s = a.alloc(2, "r1")
    a.transfer(s, "r1", "radix")
    assert a.usage() == {"radix": 2}
    other = a.alloc(1, "r2")
    with pytest.raises(SlotError, match="owned by 'r2'"):
        a.transfer(s + other, "radix", "r3")
    assert a.usage() == {"radix": 2, "r2": 1}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_arguments_are_value_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="alloc: n: expected an int >= 0"):
        SlotAllocator(2, "device").alloc(bad, "r1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity: expected an int >= 0"):
        SlotAllocator(bad)  # type: ignore[arg-type]


def test_owner_must_be_a_non_empty_str() -> None:
    with pytest.raises(ValueError, match="owner: expected a non-empty str"):
        SlotAllocator(2, "device").alloc(1, "")


def test_pool_write_read_and_copy_between_tiers() -> None:
    dev, host = device_pool(LAYOUT, 4, torch.device("cpu")), host_pool(LAYOUT, 3)
    assert dev.data.shape == (4, *LAYOUT.page_shape) and host.capacity == 3
    pages = torch.randn(2, *LAYOUT.page_shape)
    d, h = dev.alloc(2, "r1"), host.alloc(2, "r1")
    dev.write(d, pages)
    assert torch.equal(dev.read(d), pages)
    dev.copy_to(host, d, h[::-1])
    assert torch.equal(host.read(h), pages.flip(0))
    read = dev.read(d)
    read.zero_()                       # a read is a copy: the pool is unchanged
    assert torch.equal(dev.read(d), pages)
    out = torch.zeros(3, *LAYOUT.page_shape)
    assert dev.read(d[::-1], out=out[1:]).data_ptr() == out[1:].data_ptr()
    assert torch.equal(out[1:], pages.flip(0)) and not out[0].any()
    dev.free(d, "r1")
    host.free(h, "r1")
    dev.close()
    host.close()


def test_pool_refuses_pages_of_the_wrong_shape_or_dtype() -> None:
    pool = PagePool("device", 2, LAYOUT)
    slots = pool.alloc(1, "r1")
    with pytest.raises(ValueError, match=r"device.write: pages: expected shape \[n, 2, 1, 2, 1, "
                                         r"2\], got \[1, 2, 1, 4, 1, 2\]"):
        pool.write(slots, torch.zeros(1, 2, 1, 4, 1, 2))
    with pytest.raises(ValueError, match="expected dtype torch.float32, got torch.bfloat16"):
        pool.write(slots, torch.zeros(1, *LAYOUT.page_shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected 1 pages, got 2"):
        pool.write(slots, torch.zeros(2, *LAYOUT.page_shape))
    with pytest.raises(ValueError, match="1 source slots but 2 destination"):
        pool.copy_to(pool, slots, [0, 1])
    with pytest.raises(SlotError, match=r"slot 0 \(owner 'r1'\)"):
        pool.close()
