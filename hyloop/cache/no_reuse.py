"""``NoReuseCache``: the UHRC surface with no reuse, for ``cache.enable=false``.

Every match misses, inserts keep nothing (the tree side frees what it would have owned, so the
caller's bookkeeping is the same as with the real cache), locks are receipts on the root.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import ClassVar

import torch

from hyloop.cache.key import RadixKey
from hyloop.cache.node import FULL, TreeNode
from hyloop.cache.params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from hyloop.pools.page_allocator import PageAllocator
from hyloop.pools.slot_allocator import SlotAllocator


class NoReuseCache:
    """A ``PrefixCache`` like ``UnifiedRadixCache``; nothing is ever cached."""

    reuses_prefixes: ClassVar[bool] = False

    def __init__(
        self,
        kv_allocator: PageAllocator,
        page_size: int = 1,
        components: Iterable[str] = ("full",),
        sliding_window: int | None = None,
        recurrent_allocator: SlotAllocator | None = None,
        swa_allocator: PageAllocator | None = None,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.kv_allocator = kv_allocator
        self.page_size = page_size
        self.component_names = tuple(components)
        self.recurrent_allocator = recurrent_allocator
        self.root = TreeNode(b"", None, None, 0)
        self.root.component_data[FULL].value = torch.empty(0, dtype=torch.int64)
        self.root.component_data[FULL].lock_ref = 1
        self._receipt_ids = itertools.count(1)
        self._receipts: set[int] = set()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        return MatchResult(
            prefix_len=0, last_node=self.root, best_match_node=self.root, full_prefix_len=0
        )

    def peek_prefix_len(self, key: RadixKey) -> int:
        return 0

    def insert(self, params: InsertParams) -> InsertResult:
        """Frees the page-aligned part of the value (what a tree would own); the unaligned tail
        and any recurrent slot stay with the caller."""
        n = len(params.key) - len(params.key) % self.page_size
        if len(params.value) != len(params.key):
            raise ValueError(
                f"insert: value has {len(params.value)} indices for {len(params.key)} tokens"
            )
        if n:
            self.kv_allocator.free(params.value[:n])
        return InsertResult(prefix_len=0, aligned_len=n, last_node=self.root, num_freed=n)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        rid = next(self._receipt_ids)
        self._receipts.add(rid)
        return IncLockRefResult(receipt_id=rid, node=self.root, delta=0)

    def dec_lock_ref(self, params: DecLockRefParams | IncLockRefResult) -> DecLockRefResult:
        if isinstance(params, IncLockRefResult):
            params = params.to_dec_params()
        if params.receipt_id not in self._receipts or params.node_id != self.root.id:
            raise ValueError(
                f"dec_lock_ref: receipt {params.receipt_id} on node {params.node_id} is not "
                f"outstanding (already released, or not issued by this cache)"
            )
        self._receipts.discard(params.receipt_id)
        return DecLockRefResult(delta=0)

    def release_before(self, receipt: IncLockRefResult, depth: int) -> IncLockRefResult:
        return receipt  # a root receipt pins nothing

    def pinned_size(self, receipt: IncLockRefResult, component: str) -> int:
        return 0

    def num_outstanding_locks(self) -> int:
        return len(self._receipts)

    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult()

    def evictable_size(self, component: str = "full") -> int:
        return 0

    def protected_size(self, component: str = "full") -> int:
        return 0

    def total_size(self, component: str = "full") -> int:
        return 0

    def check_invariants(
        self,
        request_held_tokens: int = 0,
        pending_free_tokens: int = 0,
        request_held_slots: int = 0,
        pending_free_slots: int = 0,
    ) -> None:
        alloc = self.kv_allocator
        total = alloc.available_size() + request_held_tokens + pending_free_tokens
        if total != alloc.capacity:
            raise AssertionError(
                f"kv ledger: free + pending-free + request-held = {total}, "
                f"capacity {alloc.capacity}"
            )
        ra = self.recurrent_allocator
        if ra is not None and ra.available_size() + request_held_slots + pending_free_slots != (
            ra.capacity
        ):
            raise AssertionError("slot ledger: free + pending-free + request-held != capacity")
