"""``UnifiedRadixCache``: the UHRC tree core with the components a model's layer types need.

``components``: ``("full",)``, ``("full", "swa")`` (needs ``sliding_window``; with
``swa_allocator`` the window layers keep a pool of their own; ``swa_lock_granule``: see
``SWAComponent``) or ``("full", "recurrent")`` (needs ``recurrent_allocator``: a
``SlotAllocator``, or the engine's ``RecurrentPool``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import ClassVar

from hyloop.cache.component_base import CacheComponent, TreeHook
from hyloop.cache.component_recurrent import RecurrentComponent, SlotOwner
from hyloop.cache.component_swa import SWAComponent
from hyloop.cache.invariants import check_cache
from hyloop.cache.params import IncLockRefResult, InsertParams, InsertResult
from hyloop.cache.tree import RadixTree
from hyloop.pools import KVPool, RecurrentPool
from hyloop.pools.page_allocator import PageAllocator

_ALLOWED = ({"full"}, {"full", "swa"}, {"full", "recurrent"})


class UnifiedRadixCache(RadixTree):
    """Radix tree of token keys -> KV slot indices (plus SWA and recurrent data)."""

    def __init__(
        self,
        kv_allocator: PageAllocator,
        page_size: int = 1,
        components: Iterable[str] = ("full",),
        sliding_window: int | None = None,
        recurrent_allocator: SlotOwner | None = None,
        swa_allocator: PageAllocator | None = None,
        swa_lock_granule: int | None = None,
        marks: Sequence[TreeHook] = (),
    ) -> None:
        names = tuple(components)
        if set(names) not in _ALLOWED or len(set(names)) != len(names):
            raise ValueError(
                f"components must be one of ('full',), ('full', 'swa'), ('full', 'recurrent'); "
                f"got {names!r}"
            )
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if kv_allocator.page_size != page_size:
            raise ValueError(
                f"page_size {page_size} differs from the kv_allocator's page_size "
                f"{kv_allocator.page_size}"
            )
        aux: list[CacheComponent] = []
        if "swa" in names:
            if sliding_window is None:
                raise ValueError("components ('full', 'swa') need sliding_window=<tokens>")
            aux.append(
                SWAComponent(self, sliding_window, swa_allocator, page_size, swa_lock_granule)
            )
        elif sliding_window is not None or swa_allocator is not None:
            raise ValueError(
                f"sliding_window={sliding_window} / swa_allocator given without the 'swa' component"
            )
        if "recurrent" in names:
            if recurrent_allocator is None:
                raise ValueError(
                    "components ('full', 'recurrent') need recurrent_allocator=<SlotAllocator>"
                )
            aux.append(RecurrentComponent(self, recurrent_allocator))
        elif recurrent_allocator is not None:
            raise ValueError("recurrent_allocator given without the 'recurrent' component")
        super().__init__(kv_allocator, page_size, aux, marks)

    # -- locks ----------------------------------------------------------------------------------
    def release_before(self, receipt: IncLockRefResult, depth: int) -> IncLockRefResult:
        """Release what ``receipt``'s auxiliary locks pin of nodes ending at or before ``depth``
        (its holder's sliding window has moved past them; FULL stays locked). Returns the
        receipt to hand back later (the old one releases the same)."""
        entry = self._receipts.get(receipt.receipt_id)
        if entry is None or entry[0].node is not receipt.node:
            raise ValueError(f"release_before: receipt {receipt.receipt_id} is not outstanding")
        old, tokens = entry
        fields = {}
        for c in self.aux:
            tokens[c.kind] = c.unlock_before(old.node, tokens[c.kind], depth)
            fields.update(c.receipt_fields(tokens[c.kind]))
        new = dataclasses.replace(old, **fields)
        self._receipts[receipt.receipt_id] = (new, tokens)
        return new

    def pinned_size(self, receipt: IncLockRefResult, component: str) -> int:
        """Tokens of ``component``'s data the outstanding ``receipt`` pins."""
        entry = self._receipts.get(receipt.receipt_id)
        if entry is None:
            raise ValueError(f"pinned_size: receipt {receipt.receipt_id} is not outstanding")
        c = self._component(component)
        return c.pinned(entry[0].node, entry[1][c.kind])

    # -- sizes ----------------------------------------------------------------------------------
    def _component(self, name: str) -> CacheComponent:
        for c in self.components:
            if c.name == name:
                return c
        raise ValueError(f"component {name!r} is not in this cache's {self.component_names}")

    def evictable_size(self, component: str = "full") -> int:
        """Unlocked data the tree could evict (tokens; snapshots for a snapshot component)."""
        return self._component(component).evictable

    def protected_size(self, component: str = "full") -> int:
        """Locked data (tokens; snapshots for a snapshot component)."""
        return self._component(component).protected

    def total_size(self, component: str = "full") -> int:
        c = self._component(component)
        return c.evictable + c.protected

    def check_invariants(
        self,
        request_held_tokens: int = 0,
        pending_free_tokens: int = 0,
        request_held_slots: int = 0,
        pending_free_slots: int = 0,
    ) -> None:
        """Raise AssertionError unless the tree and its ledgers are consistent (see invariants):
        ``request_held_*`` is what requests hold, ``pending_free_*`` what waits on a launched
        step, in tokens (KV) and slots (snapshots)."""
        held = dict(
            request_held_tokens=request_held_tokens,
            pending_free_tokens=pending_free_tokens,
            request_held_slots=request_held_slots,
            pending_free_slots=pending_free_slots,
        )
        check_cache(self, held)


class NoReuseCache(UnifiedRadixCache):
    """The UHRC with no reuse, for ``cache.enable=false``: it keeps nothing, so every match
    misses, and an insert frees the page-aligned part of its value (what a tree would own; the
    unaligned tail, a snapshot slot and window pages stay with the caller), so the caller's
    bookkeeping is the one it keeps with reuse; its locks are receipts on the root."""

    reuses_prefixes: ClassVar[bool] = False

    def insert(self, params: InsertParams) -> InsertResult:
        if len(params.value) != len(params.key):
            raise ValueError(
                f"insert: value has {len(params.value)} indices for {len(params.key)} tokens"
            )
        n = len(params.key) - len(params.key) % self.page_size
        if n:
            self.kv_allocator.free(params.value[:n])
        return InsertResult(prefix_len=0, aligned_len=n, last_node=self.root, num_freed=n)


def build_cache(
    enable: bool,
    kv: KVPool,
    recurrent: RecurrentPool | None = None,
    sliding_window: int | None = None,
    swa_lock_granule: int | None = None,
    marks: Sequence[TreeHook] = (),
) -> UnifiedRadixCache:
    """The UHRC with the components a model's pools need (or the no-reuse stand-in): window
    data when the KV pool has a sliding-window pool (of the model contract's
    ``sliding_window``), snapshots when there is a recurrent one; ``marks``: hooks over the
    tree's nodes that keep no data (position-independent reuse's approximate KV)."""
    cls = UnifiedRadixCache if enable else NoReuseCache
    if kv.swa is not None:
        if sliding_window is None:
            raise ValueError("a sliding-window pool needs the model's sliding_window")
        own, granule = (kv.swa.allocator, swa_lock_granule) if enable else (None, None)
        return cls(kv.allocator, kv.page_size, ("full", "swa"), sliding_window, None, own, granule)
    if recurrent is not None:
        return cls(kv.allocator, kv.page_size, ("full", "recurrent"), recurrent_allocator=recurrent)
    return cls(kv.allocator, kv.page_size, marks=marks if enable else ())
