"""Tree nodes of the UHRC: a token segment plus one data slot per cache component."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from hyloop.cache.key import TOKEN_BYTES

FULL = 0
SWA = 1
RECURRENT = 2
NUM_COMPONENTS = 3

_node_ids = itertools.count(1)


class ComponentData:
    """One component's share of a node.

    ``value`` None is a tombstone (the component holds nothing here). FULL/SWA values are int64
    KV slot tensors aligned with the node's tokens; RECURRENT's is the snapshot slot holding the
    state after the node's last token. The ``lru_*`` fields thread the component's LRU list.
    """

    __slots__ = ("node", "value", "lock_ref", "last_access", "lru_prev", "lru_next", "in_lru")

    def __init__(self, node: TreeNode) -> None:
        self.node = node
        self.value: Any = None
        self.lock_ref = 0
        self.last_access = 0
        self.lru_prev: ComponentData | None = None
        self.lru_next: ComponentData | None = None
        self.in_lru = False


class TreeNode:
    """A radix-tree node: ``key`` is the packed token segment from the parent, ``depth`` the
    token count from the root to this node's end, ``child_key`` its key in ``parent.children``;
    ``approximate``: its KV is not what a prefill of its path computes."""

    __slots__ = (
        "id",
        "key",
        "length",
        "parent",
        "children",
        "child_key",
        "depth",
        "start_depth",
        "component_data",
        "alive",
        "heap_stamp",
        "approximate",
    )

    def __init__(self, key: bytes, parent: TreeNode | None, child_key: Any, depth: int) -> None:
        self.id = next(_node_ids)
        self.key = key
        self.length = len(key) // TOKEN_BYTES
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.child_key = child_key
        self.depth = depth
        self.start_depth = depth - self.length
        self.component_data = [ComponentData(self) for _ in range(NUM_COMPONENTS)]
        self.alive = True
        self.heap_stamp = -1  # stamp of its newest FULL eviction-heap entry; -1: none
        # Its KV is approximate: reused at another offset, or computed after such KV (so are
        # all its descendants'). An exact-prefix match never serves it
        # (``position_independent.exactness``).
        self.approximate = False

    @property
    def full_value(self) -> torch.Tensor:
        return self.component_data[FULL].value

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={self.length}, depth={self.depth})"
