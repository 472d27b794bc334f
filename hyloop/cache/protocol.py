"""``PrefixCache``: the one surface the engine sees of a prefix cache.

``UnifiedRadixCache`` (reuses prefixes) and ``NoReuseCache`` (``cache.enable=false``) both
implement it, so callers hold a ``PrefixCache`` and branch on ``reuses_prefixes``, never on the
concrete class. The bookkeeping contract is the same for both: an insert takes (or frees) the
page-aligned part of the value, every lock is released by handing back its receipt.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from hyloop.cache.key import RadixKey
from hyloop.cache.node import TreeNode
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


@runtime_checkable
class PrefixCache(Protocol):
    """Match, insert, lock and evict token prefixes; sizes are per component name
    (``"full"``, ``"swa"``, ``"recurrent"``; snapshots for ``"recurrent"``, tokens otherwise)."""

    # False: every match misses and inserts keep nothing (the caller's bookkeeping is unchanged).
    reuses_prefixes: ClassVar[bool]

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult: ...

    def insert(self, params: InsertParams) -> InsertResult: ...

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult: ...

    def dec_lock_ref(self, params: DecLockRefParams | IncLockRefResult) -> DecLockRefResult: ...

    def release_before(self, receipt: IncLockRefResult, depth: int) -> IncLockRefResult: ...

    def pinned_size(self, receipt: IncLockRefResult, component: str) -> int: ...

    def num_outstanding_locks(self) -> int: ...

    def evict(self, params: EvictParams) -> EvictResult: ...

    def peek_prefix_len(self, key: RadixKey) -> int: ...

    def evictable_size(self, component: str = "full") -> int: ...

    def protected_size(self, component: str = "full") -> int: ...

    def total_size(self, component: str = "full") -> int: ...

    def check_invariants(
        self,
        request_held_tokens: int = 0,
        pending_free_tokens: int = 0,
        request_held_slots: int = 0,
        pending_free_slots: int = 0,
    ) -> None: ...
