"""A node of the radix tree: one cached page, where it is stored, and who pins it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator


class Node:
    """One cached page: its name and tokens, where it is stored, who pins it, and (at a
    hybrid model's checkpoint) where the recurrent state after it is kept."""

    __slots__ = ("name", "tokens", "parent", "children", "depth", "device_slot", "host_slot",
                 "state_slot", "own_locks", "lock_ref", "last_access", "attached", "seq",
                 "seed")
    _seq = itertools.count()

    def __init__(self, name: bytes = b"", tokens: tuple[int, ...] = (),
                 parent: Node | None = None, seed: bytes = b"") -> None:
        self.name, self.tokens, self.parent = name, tokens, parent
        self.seed = seed   # namespace seed of the request that produced the page
        self.children: dict[bytes, Node] = {}
        self.depth = 0 if parent is None else parent.depth + 1
        self.device_slot: int | None = None
        self.host_slot: int | None = None
        self.state_slot: int | None = None
        self.own_locks = 0
        self.lock_ref = 0
        self.last_access = 0
        self.attached = True
        self.seq = next(Node._seq)

    def __repr__(self) -> str:
        return f"Node({self.name.hex()[:12] or 'root'}, depth={self.depth})"

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path(self) -> list[Node]:
        """Nodes from the root's child down to this node (empty for the root)."""
        out = []
        node: Node | None = self
        while node is not None and not node.is_root:
            out.append(node)
            node = node.parent
        return out[::-1]


def iter_nodes(root: Node) -> Iterator[Node]:
    """Every node below ``root``, parents before children."""
    stack = list(root.children.values())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())
