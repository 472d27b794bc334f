"""FULL component: the KV backbone of every node, path-to-root locks, leaf-first LRU eviction
from a persistent lazy heap (updated as nodes are touched, locked, split and removed, never
rebuilt per eviction: rebuilding a heap over every leaf on each evict is the known hot spot of
saturated radix caches)."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import torch

from hyloop.cache.component_base import CacheComponent, ComponentHost, check_pages
from hyloop.cache.node import FULL, TreeNode
from hyloop.pools.page_allocator import PageAllocator


class LeafHeap:
    """Lazy min-heap of ``(last_access, node_id, node)`` over evictable FULL leaves.

    A touched leaf pushes a fresh entry instead of moving the old one, so entries are validated
    when popped. ``node.heap_stamp`` is the newest entry's stamp, so a node is not pushed twice
    for one stamp. The heap is rebuilt only when stale entries far outnumber live leaves.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, TreeNode]] = []

    @staticmethod
    def _stamp_of(node: TreeNode) -> int:
        return node.component_data[FULL].last_access

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        stamp = self._stamp_of(node)
        if node.heap_stamp == stamp:
            return
        node.heap_stamp = stamp
        heapq.heappush(self._heap, (stamp, node.id, node))

    def pop_valid(self, is_evictable: Callable[[TreeNode], bool]) -> TreeNode | None:
        heap = self._heap
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if node.heap_stamp == stamp:
                node.heap_stamp = -1
            if node.alive and stamp == self._stamp_of(node) and is_evictable(node):
                return node
        return None

    def maybe_rebuild(self, evictable: Callable[[], list[TreeNode]], num_leaves: int) -> None:
        if len(self._heap) <= max(1024, 4 * num_leaves):
            return
        for _, _, node in self._heap:
            node.heap_stamp = -1
        entries = []
        for node in evictable():
            stamp = self._stamp_of(node)
            node.heap_stamp = stamp
            entries.append((stamp, node.id, node))
        heapq.heapify(entries)
        self._heap = entries

    def has_entry(self, node: TreeNode) -> bool:
        return node.heap_stamp == self._stamp_of(node)


class FullComponent(CacheComponent):
    """Every non-root node holds FULL KV (there are no FULL tombstones: evicting FULL removes
    the node). A lock pins the whole path to the root; eviction removes unlocked leaves in LRU
    order from a persistent lazy heap, so a parent joins the heap once its last child is gone.

    NOTE: a match or insert stamps the whole path with one counter value, so a parent's stamp is
    never older than its children's; ``check`` verifies it.
    """

    kind = FULL
    name = "full"
    priority = 2
    evict_param = "num_tokens"
    evicted_field = "num_tokens_evicted"

    def __init__(self, cache: ComponentHost, allocator: PageAllocator) -> None:
        super().__init__(cache)
        self.allocator = allocator
        self.heap = LeafHeap()

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return not node.children and node.component_data[FULL].lock_ref == 0

    def note_leaf(self, node: TreeNode) -> None:
        """``node`` may have become an evictable leaf: give it a heap entry."""
        if node.parent is not None and self._is_evictable_leaf(node):
            self.heap.push(node)

    # -- match / structure ----------------------------------------------------------------------
    def on_match(self, node: TreeNode, stamp: int) -> None:
        leaf = node
        while node.parent is not None:
            node.component_data[FULL].last_access = stamp
            node = node.parent
        self.note_leaf(leaf)

    def on_new_node(self, node: TreeNode, stamp: int) -> None:
        node.component_data[FULL].last_access = stamp
        self.evictable += node.length

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        src = lower.component_data[FULL]
        dst = upper.component_data[FULL]
        dst.lock_ref = src.lock_ref
        dst.last_access = src.last_access

    def on_delete(self, node: TreeNode) -> None:
        cd = node.component_data[FULL]
        self.evictable -= node.length
        self.cache.queue_free(FULL, cd.value)
        cd.value = None

    def free_duplicates(
        self, value: torch.Tensor, overlap: list[torch.Tensor], prefix_len: int
    ) -> int:
        """Queue the caller's copies of ``value[:prefix_len]`` that differ from the tree's.

        NOTE: slots the caller got from the tree (an earlier match) equal the tree's own and are
        kept; only true duplicates are freed. numpy compares here because these small ops are
        several times cheaper than their torch equivalents on the host.
        """
        mine = value[:prefix_len]
        mine_np = mine.numpy() if mine.device.type == "cpu" else mine.cpu().numpy()
        tree_np = [t.numpy() for t in overlap]
        same = np.equal(mine_np, tree_np[0] if len(tree_np) == 1 else np.concatenate(tree_np))
        if not same.any():
            self.cache.queue_free(FULL, mine)
            return prefix_len
        if same.all():
            return 0
        dup = mine[torch.from_numpy(~same)]
        self.cache.queue_free(FULL, dup)
        return dup.numel()

    def free(self, items: list[torch.Tensor]) -> None:
        self.allocator.free(items[0] if len(items) == 1 else torch.cat(items))

    def drop(self, node: TreeNode) -> int:
        # NOTE: FULL has no tombstones; its data leaves only with the node (``delete_leaf``).
        raise AssertionError(f"full: node {node.id} cannot be tombstoned, only removed")

    # -- locks ----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> int:
        delta = 0
        while node.parent is not None:
            cd = node.component_data[FULL]
            if cd.lock_ref == 0:
                delta += node.length
            cd.lock_ref += 1
            node = node.parent
        self.evictable -= delta
        self.protected += delta
        return delta

    def unlock(self, node: TreeNode, token: object) -> None:
        delta = 0
        while node.parent is not None:
            cd = node.component_data[FULL]
            cd.lock_ref -= 1
            if cd.lock_ref == 0:
                delta += node.length
                if not node.children:
                    self.heap.push(node)
            node = node.parent
        self.evictable += delta
        self.protected -= delta

    def expected_locks(self, node: TreeNode, token: object, counts: dict[int, int]) -> None:
        while node.parent is not None:
            counts[node.id] = counts.get(node.id, 0) + 1
            node = node.parent

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, amount: int) -> int:
        evicted = 0
        cache = self.cache
        while evicted < amount:
            node = self.heap.pop_valid(self._is_evictable_leaf)
            if node is None:
                break
            evicted += node.length
            cache.delete_leaf(node)
        self.heap.maybe_rebuild(self._evictable_leaves, len(cache.leaves))
        return evicted

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self.cache.leaves if n.component_data[FULL].lock_ref == 0]

    # -- checks ---------------------------------------------------------------------------------
    def check(self, nodes: list[TreeNode]) -> None:
        evictable = protected = 0
        for node in nodes:
            cd = node.component_data[FULL]
            if cd.value is None:
                raise AssertionError(f"full: node {node.id} in the tree has no FULL value")
            if cd.value.numel() != node.length:
                raise AssertionError(
                    f"full: node {node.id} holds {cd.value.numel()} indices for "
                    f"{node.length} tokens"
                )
            if cd.lock_ref < 0:
                raise AssertionError(f"full: node {node.id} has lock_ref {cd.lock_ref}")
            parent = node.parent
            assert parent is not None
            if parent.parent is not None:
                pcd = parent.component_data[FULL]
                if pcd.last_access < cd.last_access:
                    raise AssertionError(
                        f"full: parent {parent.id} (stamp {pcd.last_access}) is older than "
                        f"child {node.id} (stamp {cd.last_access})"
                    )
                if pcd.lock_ref < cd.lock_ref:
                    raise AssertionError(
                        f"full: parent {parent.id} lock_ref {pcd.lock_ref} < child {node.id} "
                        f"lock_ref {cd.lock_ref}"
                    )
            if cd.lock_ref:
                protected += node.length
            else:
                evictable += node.length
                if not node.children and not self.heap.has_entry(node):
                    raise AssertionError(f"full: evictable leaf {node.id} has no heap entry")
        self.check_sizes(evictable, protected)

    def check_ledger(self, nodes: list[TreeNode], held: dict[str, int]) -> None:
        tree = check_pages("kv", [n.component_data[FULL].value for n in nodes], self.allocator)
        alloc = self.allocator
        request, pending = held["request_held_tokens"], held["pending_free_tokens"]
        total = alloc.available_size() + pending + request + tree
        if total != alloc.capacity:
            raise AssertionError(
                f"kv ledger: free {alloc.available_size()} + pending-free {pending} + "
                f"request-held {request} + tree {tree} = {total}, capacity {alloc.capacity}"
            )
        if self.evictable + self.protected != tree:
            raise AssertionError("kv ledger: evictable + protected != tokens held by the tree")
