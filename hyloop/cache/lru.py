"""Persistent LRU structures: an intrusive doubly linked list and a lazy leaf heap.

Both are updated as nodes are touched, locked, split and removed, never rebuilt per eviction:
rebuilding a heap over every leaf on each evict is the known hot spot of saturated radix caches.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from hyloop.cache.node import FULL, ComponentData, TreeNode


class LRUList:
    """Doubly linked list of one component's data slots.

    NOTE: ordered by ``last_access``, newest at the head; ``check`` verifies it.
    """

    def __init__(self) -> None:
        self.size = 0
        self.head: ComponentData | None = None  # most recent
        self.tail: ComponentData | None = None  # least recent

    def push_mru(self, cd: ComponentData, stamp: int) -> None:
        if cd.in_lru:
            self.remove(cd)
        cd.last_access = stamp
        cd.lru_prev = None
        cd.lru_next = self.head
        if self.head is not None:
            self.head.lru_prev = cd
        self.head = cd
        if self.tail is None:
            self.tail = cd
        cd.in_lru = True
        self.size += 1

    def insert_after(self, anchor: ComponentData, cd: ComponentData) -> None:
        """Place ``cd`` just behind ``anchor`` (towards the tail); used for split halves."""
        cd.last_access = anchor.last_access
        nxt = anchor.lru_next
        cd.lru_prev = anchor
        cd.lru_next = nxt
        anchor.lru_next = cd
        if nxt is not None:
            nxt.lru_prev = cd
        else:
            self.tail = cd
        cd.in_lru = True
        self.size += 1

    def remove(self, cd: ComponentData) -> None:
        prev, nxt = cd.lru_prev, cd.lru_next
        if prev is not None:
            prev.lru_next = nxt
        else:
            self.head = nxt
        if nxt is not None:
            nxt.lru_prev = prev
        else:
            self.tail = prev
        cd.lru_prev = cd.lru_next = None
        cd.in_lru = False
        self.size -= 1

    def from_tail(self) -> Iterator[ComponentData]:
        """Least recent first; safe against removal of the element just yielded."""
        cd = self.tail
        while cd is not None:
            prev = cd.lru_prev
            yield cd
            cd = prev

    def check(self, name: str) -> list[ComponentData]:
        items: list[ComponentData] = []
        prev: ComponentData | None = None
        cd = self.head
        while cd is not None:
            if cd.lru_prev is not prev or not cd.in_lru:
                raise AssertionError(f"{name} LRU: broken back link at node {cd.node.id}")
            if prev is not None and prev.last_access < cd.last_access:
                raise AssertionError(
                    f"{name} LRU: node {cd.node.id} (stamp {cd.last_access}) is behind "
                    f"node {prev.node.id} (stamp {prev.last_access}) but newer"
                )
            items.append(cd)
            prev, cd = cd, cd.lru_next
        if prev is not self.tail or len(items) != self.size:
            raise AssertionError(f"{name} LRU: tail or size disagree with the links")
        return items


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
