"""The contract between the UHRC tree core and its components (FULL, SWA, RECURRENT).

The core owns the tree shape and the FULL backbone values, and knows no other component by
name; a component decides where it hits, what a lock pins, what a match refreshes, how an
insert splits and fills its data, what it adds to results and receipts, and how its data is
evicted and freed. A node that keeps no data for a component holds a tombstone there
(``value is None``), which the core skips.

The core calls the hooks of ``CacheComponent``, and of marks that keep no component data
(``TreeHook``: which nodes a match may walk into and an insert may join, what an insert marks;
e.g. ``position_independent.exactness``); a component calls back only the ``ComponentHost``
surface of the core, never its private state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from hyloop.cache.lru import LRUList
from hyloop.cache.node import FULL, TreeNode
from hyloop.cache.params import InsertParams, MatchPrefixParams
from hyloop.pools.page_allocator import PageAllocator


class ComponentHost(Protocol):
    """What a component may use of the tree core (``UnifiedRadixCache`` implements it).

    Frees are queued, not done: the core hands them to each component's ``free`` in one batch
    at the end of the operation.
    """

    leaves: set[TreeNode]

    def delete_leaf(self, node: TreeNode) -> None:
        """Remove the unlocked leaf ``node`` with every component's data."""
        ...

    def tombstone(self, node: TreeNode, comp: CacheComponent) -> bool:
        """Drop ``comp``'s data on internal ``node`` (cascading to lower priorities); False,
        changing nothing, while any of them is locked there."""
        ...

    def queue_free(self, kind: int, items: Any) -> None:
        """Give ``items`` (what component ``kind`` held) back through that component's ``free``
        at the end of the operation."""
        ...


class TreeHook:
    """What the core asks of everything it carries per node: the components, and marks (a
    flag a hook keeps on nodes, e.g. what a match may not serve). The core never reads what a
    hook keeps; it asks whether a match may walk into a node and an insert may join one, and
    tells each hook where nodes are added and split."""

    def serves(self, node: TreeNode, params: MatchPrefixParams) -> bool:
        """Whether a match for ``params`` may walk into ``node`` (False: it ends before it)."""
        return True

    # -- insert ---------------------------------------------------------------------------------
    def begin_insert(self, params: InsertParams, aligned: int) -> Any:
        """Per-insert state of an insert of ``aligned`` page-aligned tokens."""
        return None

    def joins(self, node: TreeNode, state: Any) -> bool:
        """Whether the insert may walk into existing ``node`` (False: it stops before it and
        the tree takes none of the key from there on)."""
        return True

    def overlap_cut(self, node: TreeNode, state: Any) -> int | None:
        """A depth inside existing ``node`` to split it at before the insert walks it."""
        return None

    def on_insert_overlap(self, node: TreeNode, state: Any, stamp: int) -> None:
        """An insert walked through existing ``node``."""

    def new_leaf_cuts(self, start: int, end: int, state: Any) -> list[int]:
        """Depths in ``(start, end)`` where the insert's new tokens must be split into nodes."""
        return []

    def on_new_leaf(self, node: TreeNode, state: Any, stamp: int) -> None:
        """The insert added ``node`` (after ``on_new_node``)."""

    def finish_insert(self, node: TreeNode, state: Any, stamp: int, whole: bool) -> dict[str, Any]:
        """The insert ends at ``node`` (``whole``: its key was page aligned, nothing cut off);
        returns what this hook adds to the ``InsertResult``."""
        return {}

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` (new) took the first part of ``lower``'s tokens."""

    def check(self, nodes: list[TreeNode]) -> None:
        """Invariants over all non-root nodes."""


class CacheComponent(TreeHook):
    """Base component: hits everywhere, locks nothing, holds nothing."""

    kind: int = -1
    name: str = "?"
    # Internal-node eviction priority: lower is evicted first; on a leaf every component is 0,
    # so evicting any component of a leaf removes the whole leaf.
    priority: int = 0
    # The ``EvictParams`` field that asks this component for room, and the ``EvictResult``
    # field that reports it.
    evict_param: str = ""
    evicted_field: str = ""

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

    def match_fields(self, node: TreeNode) -> dict[str, Any]:
        """What this component adds to a ``MatchResult`` ending at ``node``."""
        return {}

    # -- structure ------------------------------------------------------------------------------
    def on_new_node(self, node: TreeNode, stamp: int) -> None:
        """``node`` was just added with a FULL value."""

    def on_delete(self, node: TreeNode) -> None:
        """``node`` leaves the tree: release this component's data (``drop`` unless a component
        says otherwise)."""
        self.drop(node)

    def check_sizes(self, evictable: int, protected: int) -> None:
        """The counters ``check`` recomputed from the tree equal the kept ones."""
        if (evictable, protected) != (self.evictable, self.protected):
            raise AssertionError(
                f"{self.name}: sizes (evictable, protected) = "
                f"{(self.evictable, self.protected)}, recomputed {(evictable, protected)}"
            )

    def drop(self, node: TreeNode) -> int:
        """Tombstone this component's (unlocked) data on ``node``, which stays in the tree;
        returns what was dropped (tokens, or snapshots for RECURRENT). Called by the core's
        ``tombstone`` cascade."""
        return 0

    def free(self, items: list[Any]) -> None:
        """Give what ``queue_free`` collected back to this component's allocator."""

    # -- locks ----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> Any:
        """Pin data for a request at ``node``; the return value goes into the receipt."""
        return None

    def unlock(self, node: TreeNode, token: Any) -> None:
        """Undo ``lock`` given what it returned."""

    def receipt_fields(self, token: Any) -> dict[str, Any]:
        """What this component adds to an ``IncLockRefResult`` given what ``lock`` returned."""
        return {}

    def expected_locks(self, node: TreeNode, token: Any, counts: dict[int, int]) -> None:
        """Add the lock refs a receipt accounts for into ``counts`` (node id -> refs)."""

    def lock_cuts(self, node: TreeNode) -> list[int]:
        """Depths above ``node`` (page multiples, inside ancestors) to split the path at before a
        lock at ``node``, so the lock pins whole nodes of exactly what its holder reads."""
        return []

    def unlock_before(self, node: TreeNode, token: Any, depth: int) -> Any:
        """Release what a lock at ``node`` pins of nodes ending at or before ``depth`` (its
        holder reads no further back); returns the receipt's new token."""
        return token

    def pinned(self, node: TreeNode, token: Any) -> int:
        """Tokens of this component's data a lock at ``node`` pins."""
        return 0

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, amount: int) -> int:
        return 0

    def evict_lru(self, lru: LRUList, amount: int, unit: Callable[[TreeNode], int]) -> int:
        """Drop unlocked data from ``lru``'s tail until ``amount`` (in ``unit`` per node) is
        gone: a leaf goes whole (every component is priority 0 there), an internal node's
        data is tombstoned, cascading to lower priorities."""
        evicted = 0
        for cd in lru.from_tail():
            if evicted >= amount:
                break
            if cd.lock_ref:
                continue
            node = cd.node
            if not node.children and node.component_data[FULL].lock_ref == 0:
                evicted += unit(node)
                self.cache.delete_leaf(node)
            elif self.cache.tombstone(node, self):
                evicted += unit(node)
        return evicted

    # -- checks ---------------------------------------------------------------------------------
    def check_ledger(self, nodes: list[TreeNode], held: dict[str, int]) -> None:
        """This component's pool against what the tree holds; ``held`` says what requests
        hold and what waits on a launched step (``invariants.check_cache``)."""


def check_pages(label: str, values: list[torch.Tensor], allocator: PageAllocator) -> int:
    """Slots ``values`` hold are each held once, in whole pages, none of them free; returns how
    many there are."""
    held = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
    if held.numel() != torch.unique(held).numel():
        raise AssertionError(f"{label} ledger: a slot is held by two tree nodes")
    ps = allocator.page_size
    pages = torch.unique(held // ps).numpy()
    if len(pages) * ps != held.numel():
        raise AssertionError(f"{label} ledger: tree nodes hold partial pages")
    both = pages[allocator.is_free_page(pages)]  # the free bitmap: no set of the whole free list
    if len(both):
        raise AssertionError(
            f"{label} ledger: pages {both[:8].tolist()} are both free and in the tree"
        )
    return held.numel()
