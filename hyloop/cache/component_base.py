"""The contract between the UHRC tree core and its components (FULL, SWA, RECURRENT).

The core owns the tree shape and the FULL backbone values; a component decides where it hits,
what a lock pins, what a match refreshes and how its data is evicted. A node that keeps no data
for a component holds a tombstone there (``value is None``), which the core skips.

The core calls the hooks of ``CacheComponent``; a component calls back only the
``ComponentHost`` surface of the core, never its private state.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hyloop.cache.node import TreeNode


class ComponentHost(Protocol):
    """What a component may use of the tree core (``UnifiedRadixCache`` implements it).

    Frees are queued, not done: the core hands them to the allocators in one batch at the end
    of the operation.
    """

    leaves: set[TreeNode]

    def delete_leaf(self, node: TreeNode) -> None:
        """Remove the unlocked leaf ``node`` with every component's data."""
        ...

    def tombstone(self, node: TreeNode, comp: CacheComponent) -> bool:
        """Drop ``comp``'s data on internal ``node`` (cascading to lower priorities); False,
        changing nothing, while any of them is locked there."""
        ...

    def queue_kv_free(self, indices: torch.Tensor) -> None:
        """Give KV slot ``indices`` back to the KV allocator at the end of the operation."""
        ...

    def queue_swa_free(self, indices: torch.Tensor) -> None:
        """Give sliding-window pool slot ``indices`` back at the end of the operation."""
        ...

    def queue_slot_free(self, slot: int) -> None:
        """Give a recurrent snapshot ``slot`` back to its allocator at the end of the operation."""
        ...


class CacheComponent:
    """Base component: hits everywhere, locks nothing, holds nothing."""

    kind: int = -1
    name: str = "?"
    # Internal-node eviction priority: lower is evicted first; on a leaf every component is 0,
    # so evicting any component of a leaf removes the whole leaf.
    priority: int = 0

    def __init__(self, cache: ComponentHost) -> None:
        self.cache = cache
        self.evictable = 0
        self.protected = 0

    # -- match ----------------------------------------------------------------------------------
    def hit_context(self, path: list[TreeNode]) -> Any:
        """Per-match precomputation over the matched path (root excluded)."""
        return None

    def hits_at(self, ctx: Any, path: list[TreeNode], i: int, m: int) -> bool:
        """Whether this component can serve the prefix ``path[:i]`` plus ``m`` tokens of
        ``path[i]`` (``m == 0``: the prefix ends at the end of ``path[i - 1]``, or the root)."""
        return True

    def on_match(self, node: TreeNode, stamp: int) -> None:
        """Refresh LRU for a hit ending at ``node``."""

    # -- structure ------------------------------------------------------------------------------
    def on_new_node(self, node: TreeNode, stamp: int) -> None:
        """``node`` was just added with a FULL value."""

    def on_insert_overlap(self, node: TreeNode, stamp: int) -> None:
        """An insert walked through existing ``node``."""

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` (new) took the first part of ``lower``'s tokens."""

    def on_delete(self, node: TreeNode) -> None:
        """``node`` leaves the tree: release this component's data."""

    def drop(self, node: TreeNode) -> int:
        """Tombstone this component's (unlocked) data on ``node``, which stays in the tree;
        returns what was dropped (tokens, or snapshots for RECURRENT). Called by the core's
        ``tombstone`` cascade."""
        return 0

    # -- locks ----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> Any:
        """Pin data for a request at ``node``; the return value goes into the receipt."""
        return None

    def unlock(self, node: TreeNode, token: Any) -> None:
        """Undo ``lock`` given what it returned."""

    def expected_locks(self, node: TreeNode, token: Any, counts: dict[int, int]) -> None:
        """Add the lock refs a receipt accounts for into ``counts`` (node id -> refs)."""

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, amount: int) -> int:
        return 0

    # -- checks ---------------------------------------------------------------------------------
    def check(self, nodes: list[TreeNode]) -> None:
        """Component invariants over all non-root nodes."""
