"""The persistent LRU list of the auxiliary components: an intrusive doubly linked list,
updated as nodes are touched, locked, split and removed, never rebuilt per eviction (FULL keeps a
lazy leaf heap the same way, ``component_full.LeafHeap``)."""

from __future__ import annotations

from collections.abc import Iterator

from hyloop.cache.node import ComponentData


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
