"""RECURRENT component: recurrent-state snapshots on nodes, single-node locks.

A snapshot slot on a node holds the recurrent state after the node's last token, so a recurrent
hit needs a snapshot exactly at the hit boundary: the deepest matched node carrying one. The
engine copies that snapshot into the request's own slot (copy-on-write); the tree keeps its
slot. Snapshots may sit on internal nodes; eviction tombstones them there (priority 0) and
removes a snapshot leaf whole.
"""

from __future__ import annotations

from typing import Any, Protocol

from hyloop.cache.component_base import CacheComponent, ComponentHost
from hyloop.cache.lru import LRUList
from hyloop.cache.node import RECURRENT, TreeNode
from hyloop.cache.params import InsertParams


class SlotOwner(Protocol):
    """Where snapshot slots come from and go back to: a ``SlotAllocator``, or the engine's
    ``RecurrentPool`` (whose ``free`` keeps its slot roles and the step fence)."""

    capacity: int

    def available_size(self) -> int: ...

    def free(self, slots: list[int]) -> None: ...


class RecurrentComponent(CacheComponent):
    kind = RECURRENT
    name = "recurrent"
    priority = 0
    evict_param = "recurrent_num"
    evicted_field = "recurrent_num_evicted"

    def __init__(self, cache: ComponentHost, allocator: SlotOwner) -> None:
        super().__init__(cache)
        self.allocator = allocator
        self.lru = LRUList()

    # -- match ----------------------------------------------------------------------------------
    def hits_at(self, ctx: object, path: list[TreeNode], i: int, m: int) -> bool:
        if m:
            return False  # inside a node there is no state
        return i == 0 or path[i - 1].component_data[RECURRENT].value is not None

    def on_match(self, node: TreeNode, stamp: int) -> None:
        # Only the snapshot that is used is refreshed, not the chain above it.
        cd = node.component_data[RECURRENT]
        if cd.value is not None:
            self.lru.push_mru(cd, stamp)

    def match_fields(self, node: TreeNode) -> dict[str, Any]:
        slot = node.component_data[RECURRENT].value
        return {"recurrent_hit": slot is not None, "recurrent_slot": slot}

    # -- insert ---------------------------------------------------------------------------------
    def begin_insert(self, params: InsertParams, aligned: int) -> int | None:
        return None if params.recurrent_slot is None else int(params.recurrent_slot)

    def finish_insert(
        self, node: TreeNode, state: int | None, stamp: int, whole: bool
    ) -> dict[str, Any]:
        """A snapshot is the state after the whole key: taken only when nothing was cut off."""
        if state is None or not whole:
            return {}
        return {"recurrent_taken": True, "recurrent_stored": self.attach(node, state, stamp)}

    # -- structure ------------------------------------------------------------------------------
    def attach(self, node: TreeNode, slot: int, stamp: int) -> bool:
        """Give ``node`` the snapshot ``slot``; returns True when stored, False when ``node``
        already had one (then ``slot`` is a duplicate and is freed)."""
        cd = node.component_data[RECURRENT]
        if cd.value is not None:
            if cd.value != slot:
                self.cache.queue_free(RECURRENT, slot)
            self.lru.push_mru(cd, stamp)
            return False
        cd.value = slot
        if cd.lock_ref:
            self.protected += 1
        else:
            self.evictable += 1
        self.lru.push_mru(cd, stamp)
        return True

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        # The state after the segment's last token stays with the lower half; the new upper
        # half has none and no single-node lock.
        return

    def drop(self, node: TreeNode) -> int:
        """Tombstone ``node``'s snapshot (unlocked) and queue its slot's free; returns 1 when
        there was one."""
        cd = node.component_data[RECURRENT]
        if cd.value is None:
            return 0
        self.lru.remove(cd)
        self.cache.queue_free(RECURRENT, cd.value)
        cd.value = None
        self.evictable -= 1
        return 1

    def free(self, items: list[int]) -> None:
        self.allocator.free(items)

    # -- locks ----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> bool:
        cd = node.component_data[RECURRENT]
        if cd.value is None:
            return False
        if cd.lock_ref == 0:
            self.evictable -= 1
            self.protected += 1
        cd.lock_ref += 1
        return True

    def receipt_fields(self, token: Any) -> dict[str, Any]:
        return {"recurrent_locked": bool(token)}

    def unlock(self, node: TreeNode, token: object) -> None:
        if not token:
            return
        cd = node.component_data[RECURRENT]
        cd.lock_ref -= 1
        if cd.lock_ref == 0:
            self.evictable += 1
            self.protected -= 1

    def expected_locks(self, node: TreeNode, token: object, counts: dict[int, int]) -> None:
        if token:
            counts[node.id] = counts.get(node.id, 0) + 1

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, amount: int) -> int:
        return self.evict_lru(self.lru, amount, lambda node: 1)

    # -- checks ---------------------------------------------------------------------------------
    def check(self, nodes: list[TreeNode]) -> None:
        listed = {id(cd) for cd in self.lru.check("recurrent")}
        evictable = protected = 0
        seen: set[int] = set()
        for node in nodes:
            cd = node.component_data[RECURRENT]
            if cd.lock_ref < 0 or (cd.lock_ref and cd.value is None):
                raise AssertionError(
                    f"recurrent: node {node.id} lock_ref {cd.lock_ref} with value {cd.value}"
                )
            if (cd.value is not None) != (id(cd) in listed):
                raise AssertionError(f"recurrent: node {node.id} LRU membership disagrees")
            if cd.value is None:
                continue
            if cd.value in seen:
                raise AssertionError(f"recurrent: slot {cd.value} is held by two nodes")
            seen.add(cd.value)
            if cd.lock_ref:
                protected += 1
            else:
                evictable += 1
        if len(listed) != len(seen):
            raise AssertionError("recurrent: LRU holds nodes that are not in the tree")
        self.check_sizes(evictable, protected)

    def check_ledger(self, nodes: list[TreeNode], held: dict[str, int]) -> None:
        tree = [n.component_data[RECURRENT].value for n in nodes]
        tree = [s for s in tree if s is not None]
        alloc = self.allocator
        request, pending = held["request_held_slots"], held["pending_free_slots"]
        total = alloc.available_size() + pending + request + len(tree)
        if total != alloc.capacity:
            raise AssertionError(
                f"slot ledger: free {alloc.available_size()} + pending-free {pending} + "
                f"request-held {request} + tree {len(tree)} = {total}, capacity {alloc.capacity}"
            )
