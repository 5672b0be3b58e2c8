"""The radix tree's invariants, checked from the outside (tests, ``close``, debugging).

    every node below the root holds a device slot, a host slot, or both
    device residency is prefix-closed: a node on device has its parent on device
    lock_ref(node) = own locks + sum(lock_ref(child)); the own locks add up to the count
    the pools' slots of ``owner`` are exactly the slots held by nodes, each held once
    (the state pool's too: a state slot belongs to a node that holds a page)
"""

from __future__ import annotations

from pd_cache.kv.base import CacheInvariantError
from pd_cache.kv.node import Node, iter_nodes
from pd_cache.kv.pool import PagePool, SlotPool


def check_tree(root: Node, device: PagePool, host: PagePool, *, page_size: int,
               num_locks: int, owner: str, states: SlotPool | None = None) -> None:
    """Raise ``CacheInvariantError`` naming the first broken invariant."""
    held: dict[str, dict[int, Node]] = {"device": {}, "host": {}, "state": {}}
    total_locks = root.own_locks
    for n in iter_nodes(root):
        _check_node(n, page_size)
        total_locks += n.own_locks
        _claim(held["device"], n.device_slot, n, "device")
        _claim(held["host"], n.host_slot, n, "host")
        _claim(held["state"], n.state_slot, n, "state")
    _check_lock_refs(root)
    if total_locks != num_locks:
        raise CacheInvariantError(f"{total_locks} locks on nodes, {num_locks} counted")
    if states is None and held["state"]:
        raise CacheInvariantError("nodes hold state slots but the tree has no state pool")
    for pool in (device, host) if states is None else (device, host, states):
        owned = set(pool.allocator.owned_by(owner))
        if owned != set(held[pool.name]):
            raise CacheInvariantError(f"{pool.name}: pool slots owned by {owner!r} "
                                      f"{sorted(owned)} != tree slots {sorted(held[pool.name])}")


def _check_node(n: Node, page_size: int) -> None:
    where = f"node {n.name.hex()[:12]} (depth {n.depth})"
    if n.device_slot is None and n.host_slot is None:
        raise CacheInvariantError(f"{where}: holds no slot in any tier")
    if len(n.tokens) != page_size:
        raise CacheInvariantError(f"{where}: {len(n.tokens)} tokens, not a full page")
    parent = n.parent
    if parent is None or parent.children.get(n.name) is not n or not n.attached:
        raise CacheInvariantError(f"{where}: not linked to its parent")
    if n.device_slot is not None and not parent.is_root and parent.device_slot is None:
        raise CacheInvariantError(f"{where}: on device but its parent is not")


def _check_lock_refs(root: Node) -> None:
    stack = [root]
    while stack:
        n = stack.pop()
        want = n.own_locks + sum(c.lock_ref for c in n.children.values())
        if n.lock_ref != want or n.own_locks < 0:
            raise CacheInvariantError(f"node {n.name.hex()[:12] or 'root'}: lock_ref "
                                      f"{n.lock_ref}, expected {want}")
        stack.extend(n.children.values())


def _claim(held: dict[int, Node], slot: int | None, node: Node, tier: str) -> None:
    if slot is None:
        return
    if slot in held:
        raise CacheInvariantError(f"{tier} slot {slot} held by two nodes")
    held[slot] = node
