"""The Unified Hybrid Radix Cache (UHRC) tree core.

One radix tree over token keys, shared by the cache components (FULL KV, sliding-window KV,
recurrent snapshots). The core owns the tree shape and the FULL KV indices; components decide
where they hit, what a lock pins, what a match refreshes and how they evict. With
``page_size > 1`` keys are matched and split at page multiples.

A request's lifecycle, as the engine drives it::

    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt, extra_key=tenant)))
    lock = cache.inc_lock_ref(m.last_node)      # pins m.device_indices (prefix_len tokens)
    # page table [0:m.prefix_len] = m.device_indices; with RECURRENT, copy m.recurrent_slot
    # into the request's own state slot when m.recurrent_hit.
    # As chunked prefill completes pages (and at the end), insert what the request holds:
    r = cache.insert(InsertParams(key=RadixKey(tokens, tenant), value=page_table[: len(tokens)]))
    # The tree freed the request's duplicates of value[:r.prefix_len]; it now owns
    # value[:r.aligned_len]. Re-read the tree's indices and move the lock:
    m2 = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, tenant), full_only=True))
    # page table [0:m2.prefix_len] = m2.device_indices
    new_lock = cache.inc_lock_ref(r.last_node)
    cache.dec_lock_ref(lock.to_dec_params())
    # At the end: release the lock; the request frees only its unaligned tail
    # value[r.aligned_len:] (and its state slot, unless it was handed over as recurrent_slot).
    cache.dec_lock_ref(new_lock.to_dec_params())

When the allocator is short the engine calls ``evict(EvictParams(num_tokens=...))``; admission
budgets with ``evictable_size()``. ``peek_prefix_len`` probes without side effects (routing).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
import torch

from hyloop.cache.component_base import CacheComponent
from hyloop.cache.component_full import FullComponent
from hyloop.cache.component_recurrent import RecurrentComponent
from hyloop.cache.component_swa import SWAComponent
from hyloop.cache.key import TOKEN_BYTES, RadixKey, page_match_bytes
from hyloop.cache.node import FULL, RECURRENT, SWA, TreeNode
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

_ALLOWED = ({"full"}, {"full", "swa"}, {"full", "recurrent"})


class UnifiedRadixCache:
    """Radix tree of token keys -> KV slot indices (plus SWA and recurrent data).

    ``components``: ``("full",)``, ``("full", "swa")`` (needs ``sliding_window``) or
    ``("full", "recurrent")`` (needs ``recurrent_allocator``). Implements ``PrefixCache`` for
    the engine and ``ComponentHost`` for its components.
    """

    reuses_prefixes: ClassVar[bool] = True

    def __init__(
        self,
        kv_allocator: PageAllocator,
        page_size: int = 1,
        components: Iterable[str] = ("full",),
        sliding_window: int | None = None,
        recurrent_allocator: SlotAllocator | None = None,
        swa_allocator: PageAllocator | None = None,
    ) -> None:
        names = tuple(components)
        if set(names) not in _ALLOWED or len(set(names)) != len(names):
            raise ValueError(
                f"components must be one of ('full',), ('full', 'swa'), ('full', 'recurrent'); "
                f"got {names!r}"
            )
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        alloc_ps = getattr(kv_allocator, "page_size", page_size)
        if alloc_ps != page_size:
            raise ValueError(
                f"page_size {page_size} differs from the kv_allocator's page_size {alloc_ps}"
            )
        self.kv_allocator = kv_allocator
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self.component_names = names
        self.root = TreeNode(b"", None, None, 0)
        self.root.component_data[FULL].value = torch.empty(0, dtype=torch.int64)
        self.root.component_data[FULL].lock_ref = 1  # the root is never evicted
        self.leaves: set[TreeNode] = set()
        self._stamp = 0
        self._receipt_ids = itertools.count(1)
        # receipt id -> (receipt, what each component's lock returned, by component kind)
        self._receipts: dict[int, tuple[IncLockRefResult, dict[int, Any]]] = {}
        self._kv_to_free: list[torch.Tensor] = []
        self._swa_to_free: list[torch.Tensor] = []
        self._slots_to_free: list[int] = []
        # Told of every node the tree removes (e.g. the position-independent donor index).
        self.delete_listeners: list[Callable[[TreeNode], None]] = []

        self.full = FullComponent(self)
        self.swa: SWAComponent | None = None
        self.recurrent: RecurrentComponent | None = None
        if "swa" in names:
            if sliding_window is None:
                raise ValueError("components ('full', 'swa') need sliding_window=<tokens>")
            if swa_allocator is not None and swa_allocator.page_size != page_size:
                raise ValueError(
                    f"swa_allocator page_size {swa_allocator.page_size} differs from {page_size}"
                )
            self.swa = SWAComponent(self, sliding_window, swa_allocator)
        elif sliding_window is not None or swa_allocator is not None:
            raise ValueError(
                f"sliding_window={sliding_window} / swa_allocator given without the 'swa' component"
            )
        if "recurrent" in names:
            if recurrent_allocator is None:
                raise ValueError(
                    "components ('full', 'recurrent') need recurrent_allocator=<SlotAllocator>"
                )
            self.recurrent = RecurrentComponent(self, recurrent_allocator)
        elif recurrent_allocator is not None:
            raise ValueError("recurrent_allocator given without the 'recurrent' component")
        self.aux: list[CacheComponent] = [c for c in (self.swa, self.recurrent) if c is not None]
        self.components: list[CacheComponent] = [self.full, *self.aux]

    # -- helpers --------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._stamp += 1
        return self._stamp

    def _walk(self, key: RadixKey) -> tuple[list[TreeNode], int]:
        """Nodes the key matches from the root, and how many tokens into the last one the match
        ends when it ends inside it (0 when it ends on a node boundary). No side effects."""
        tokens = key.packed
        pb = self._page_bytes
        n = len(tokens)
        path: list[TreeNode] = []
        if n < pb:
            return path, 0
        child = self.root.children.get((key.extra_key, tokens[:pb]))
        pos = 0
        while child is not None:
            path.append(child)
            m = page_match_bytes(child.key, tokens, pos, pb)
            if m < len(child.key):
                return path, m // TOKEN_BYTES
            pos += m
            if pos + pb > n:
                break
            child = child.children.get(tokens[pos : pos + pb])
        return path, 0

    def _select_hit(self, path: list[TreeNode], partial: int, full_only: bool) -> tuple[int, int]:
        """Deepest ``(i, m)`` every component hits: ``path[:i]`` plus ``m`` tokens of path[i]."""
        whole = len(path) - 1 if partial else len(path)
        if full_only or not self.aux:
            return (whole, partial) if partial else (whole, 0)
        ctxs = [(c, c.hit_context(path)) for c in self.aux]
        if partial and all(c.hits_at(ctx, path, whole, partial) for c, ctx in ctxs):
            return whole, partial
        for i in range(whole, 0, -1):
            if all(c.hits_at(ctx, path, i, 0) for c, ctx in ctxs):
                return i, 0
        return 0, 0

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut ``node`` after ``m`` tokens; the new upper node is returned, ``node`` keeps the
        rest (so receipts anchored on ``node`` stay valid)."""
        parent = node.parent
        assert parent is not None and 0 < m < node.length and m % self.page_size == 0
        mb = m * TOKEN_BYTES
        upper = TreeNode(node.key[:mb], parent, node.child_key, node.start_depth + m)
        parent.children[node.child_key] = upper
        value = node.component_data[FULL].value
        upper.component_data[FULL].value = value[:m]
        node.component_data[FULL].value = value[m:]
        node.key = node.key[mb:]
        node.length -= m
        node.child_key = node.key[: self._page_bytes]
        node.parent = upper
        upper.children[node.child_key] = node
        for c in self.components:
            c.on_split(upper, node)
        return upper

    def _add_leaf(
        self, parent: TreeNode, extra_key: Any, key: bytes, value: torch.Tensor, stamp: int
    ) -> TreeNode:
        ck: Any = key[: self._page_bytes]
        if parent.parent is None:
            ck = (extra_key, ck)
        node = TreeNode(key, parent, ck, parent.depth + len(key) // TOKEN_BYTES)
        node.component_data[FULL].value = value
        if not parent.children:
            self.leaves.discard(parent)
        parent.children[ck] = node
        self.leaves.add(node)
        for c in self.components:
            c.on_new_node(node, stamp)
        self.full.note_leaf(node)
        return node

    def _free_duplicates(
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
            self._kv_to_free.append(mine)
            return prefix_len
        if same.all():
            return 0
        dup = mine[torch.from_numpy(~same)]
        self._kv_to_free.append(dup)
        return dup.numel()

    def _flush_frees(self) -> None:
        if self._kv_to_free:
            vals = self._kv_to_free
            self._kv_to_free = []
            self.kv_allocator.free(vals[0] if len(vals) == 1 else torch.cat(vals))
        if self._swa_to_free:
            vals = self._swa_to_free
            self._swa_to_free = []
            assert self.swa is not None and self.swa.allocator is not None
            self.swa.allocator.free(torch.cat(vals))
        if self._slots_to_free:
            slots = self._slots_to_free
            self._slots_to_free = []
            assert self.recurrent is not None
            self.recurrent.allocator.free(slots)

    # -- component surface (ComponentHost) ------------------------------------------------------
    def delete_leaf(self, node: TreeNode) -> None:
        """Remove an unlocked leaf with all its component data (freed in one batch later)."""
        for c in self.components:
            c.on_delete(node)
        parent = node.parent
        assert parent is not None
        del parent.children[node.child_key]
        node.alive = False
        self.leaves.discard(node)
        for listener in self.delete_listeners:
            listener(node)
        if parent.parent is not None and not parent.children:
            self.leaves.add(parent)
            self.full.note_leaf(parent)

    def tombstone(self, node: TreeNode, comp: CacheComponent) -> bool:
        """Drop ``comp``'s data on ``node`` and, cascading, every auxiliary component of lower
        or equal priority; refused (False) while any of them is locked there."""
        targets = [c for c in self.aux if c.priority <= comp.priority]
        if any(node.component_data[c.kind].lock_ref for c in targets):
            return False
        for c in targets:
            c.drop(node)
        return True

    def queue_kv_free(self, indices: torch.Tensor) -> None:
        self._kv_to_free.append(indices)

    def queue_swa_free(self, indices: torch.Tensor) -> None:
        self._swa_to_free.append(indices)

    def queue_slot_free(self, slot: int) -> None:
        self._slots_to_free.append(slot)

    # -- match ----------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest prefix of ``params.key`` that every component can serve.

        Splits the node the hit ends in (at a page multiple) and refreshes each component's LRU.
        """
        path, partial = self._walk(params.key)
        full_len = path[-1].start_depth + partial if partial else (path[-1].depth if path else 0)
        i, m = self._select_hit(path, partial, params.full_only)
        if m:
            node = self._split(path[i], m)
            nodes = path[:i]
            nodes.append(node)
        else:
            nodes = path[:i]
            node = nodes[-1] if nodes else self.root
        stamp = self._tick()
        for c in self.components:
            c.on_match(node, stamp)
        slot = node.component_data[RECURRENT].value if self.recurrent is not None else None
        return MatchResult(
            prefix_len=node.depth,
            last_node=node,
            best_match_node=node,
            full_prefix_len=full_len,
            recurrent_hit=slot is not None,
            recurrent_slot=slot,
            node_values=[n.component_data[FULL].value for n in nodes],
        )

    def peek_prefix_len(self, key: RadixKey) -> int:
        """What ``match_prefix`` would return as ``prefix_len``, read-only: no split, no LRU."""
        path, partial = self._walk(key)
        i, m = self._select_hit(path, partial, False)
        if m:
            return path[i].start_depth + m
        return path[i - 1].depth if i else 0

    # -- insert ---------------------------------------------------------------------------------
    def insert(self, params: InsertParams) -> InsertResult:
        """Insert the page-aligned part of ``params.key`` with its KV indices (see InsertResult)."""
        key = params.key
        tokens = key.packed
        ntok = len(key)
        value = params.value
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or len(value) != ntok:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"insert: value must be a 1-D tensor with one index per token ({ntok}), got {got}"
            )
        pb = self._page_bytes
        n = ntok - ntok % self.page_size
        nb = n * TOKEN_BYTES
        stamp = self._tick()
        node = self.root
        pos = 0  # bytes
        overlap: list[torch.Tensor] = []
        aux = self.aux
        swa_from, swa_keep = self._swa_range(params, n)
        taken: list[tuple[int, int]] = []
        while pos < nb:
            ck = tokens[pos : pos + pb]
            child = node.children.get((key.extra_key, ck) if node is self.root else ck)
            if child is None:
                break
            m = page_match_bytes(child.key, tokens, pos, pb)
            if m < len(child.key):
                child = self._split(child, m // TOKEN_BYTES)
            window_less = child.component_data[SWA].value is None
            if window_less and child.start_depth < swa_from < child.depth:
                child = self._split(child, swa_from - child.start_depth)  # fill from swa_from
            child.component_data[FULL].last_access = stamp
            for c in aux:
                c.on_insert_overlap(child, stamp)
            if window_less and child.start_depth >= swa_from:
                self._fill_swa(child, params, taken, stamp)
            overlap.append(child.component_data[FULL].value)
            pos += len(child.key)
            node = child
        prefix_len = pos // TOKEN_BYTES
        if pos < nb:
            start = prefix_len
            if prefix_len < swa_keep < n:  # the window before the end gets a node of its own
                own = value[prefix_len:swa_keep].to(dtype=torch.int64, copy=True)
                cut = swa_keep * TOKEN_BYTES
                node = self._add_leaf(node, key.extra_key, tokens[pos:cut], own, stamp)
                start = swa_keep
            own = value[start:n].to(dtype=torch.int64, copy=True)
            node = self._add_leaf(node, key.extra_key, tokens[start * TOKEN_BYTES : nb], own, stamp)
            if swa_keep < n:
                self._fill_swa(node, params, taken, stamp)
        else:
            self.full.note_leaf(node)
        num_freed = self._free_duplicates(value, overlap, prefix_len) if prefix_len else 0
        swa_taken = taken
        taken = stored = False
        if params.recurrent_slot is not None:
            if self.recurrent is None:
                raise ValueError(
                    f"insert: recurrent_slot={params.recurrent_slot} given but the cache has "
                    f"components {self.component_names}"
                )
            if n == ntok and n > 0:
                stored = self.recurrent.attach(node, int(params.recurrent_slot), stamp)
                taken = True
        self._flush_frees()
        return InsertResult(
            prefix_len=prefix_len,
            aligned_len=n,
            last_node=node,
            num_freed=num_freed,
            recurrent_taken=taken,
            recurrent_stored=stored,
            swa_taken=tuple(swa_taken),
        )

    def _swa_range(self, params: InsertParams, n: int) -> tuple[int, int]:
        """``(swa_from, swa_keep)`` of an insert of ``n`` aligned tokens: window-less nodes the
        tree has are filled from ``swa_from``; new nodes keep window data from ``swa_keep``
        (the window before the end). ``(n, n)`` when nothing is handed in."""
        swa = self.swa
        if swa is None or swa.allocator is None or params.swa_value is None:
            return n, n
        if params.swa_value.dim() != 1 or len(params.swa_value) != len(params.key):
            raise ValueError(
                f"insert: swa_value must be a 1-D tensor with one index per token "
                f"({len(params.key)}), got {tuple(params.swa_value.shape)}"
            )
        ps = self.page_size
        swa_from = min(n, -(-max(0, params.swa_from) // ps) * ps)
        keep = max(swa_from, (n - swa.window) // ps * ps)
        return swa_from, min(n, keep)

    def _fill_swa(
        self, node: TreeNode, params: InsertParams, taken: list[tuple[int, int]], stamp: int
    ) -> None:
        assert self.swa is not None and params.swa_value is not None
        a, b = node.start_depth, node.depth
        self.swa.fill(node, params.swa_value[a:b].to(dtype=torch.int64, copy=True), stamp)
        if taken and taken[-1][1] == a:
            taken[-1] = (taken[-1][0], b)
        else:
            taken.append((a, b))

    # -- locks ----------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Pin what a request at ``node`` reads; release by handing back the receipt."""
        if not isinstance(node, TreeNode) or not node.alive:
            raise ValueError(f"inc_lock_ref: {node!r} is not a live node of this tree")
        tokens = {c.kind: c.lock(node) for c in self.components}
        rid = next(self._receipt_ids)
        receipt = IncLockRefResult(
            receipt_id=rid,
            node=node,
            delta=tokens[FULL],
            swa_start_depth=tokens.get(SWA),
            recurrent_locked=bool(tokens.get(RECURRENT, False)),
        )
        self._receipts[rid] = (receipt, tokens)
        return receipt

    def dec_lock_ref(self, params: DecLockRefParams | IncLockRefResult) -> DecLockRefResult:
        """Release the lock a receipt stands for; a double or foreign release raises and
        changes nothing."""
        if isinstance(params, IncLockRefResult):
            params = params.to_dec_params()
        entry = self._receipts.get(params.receipt_id)
        if entry is None:
            raise ValueError(
                f"dec_lock_ref: receipt {params.receipt_id} is not outstanding "
                f"(already released, or not issued by this cache)"
            )
        receipt, tokens = entry
        if receipt.node.id != params.node_id:
            raise ValueError(
                f"dec_lock_ref: receipt {params.receipt_id} locked node {receipt.node.id}, "
                f"got node_id {params.node_id}"
            )
        del self._receipts[params.receipt_id]
        before = self.full.evictable
        for c in self.components:
            c.unlock(receipt.node, tokens[c.kind])
        return DecLockRefResult(delta=self.full.evictable - before)

    def num_outstanding_locks(self) -> int:
        return len(self._receipts)

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """Cascade RECURRENT -> SWA -> FULL, each in its LRU order; locked data stays."""
        before = [c.evictable + c.protected for c in self.components]
        if params.recurrent_num > 0 and self.recurrent is not None:
            self.recurrent.evict(params.recurrent_num)
        if params.swa_num_tokens > 0 and self.swa is not None:
            self.swa.evict(params.swa_num_tokens)
        if params.num_tokens > 0:
            self.full.evict(params.num_tokens)
        self._flush_frees()
        gone = {
            c.kind: b - c.evictable - c.protected
            for c, b in zip(self.components, before, strict=True)
        }
        return EvictResult(
            num_tokens_evicted=gone[FULL],
            swa_num_tokens_evicted=gone.get(SWA, 0),
            recurrent_num_evicted=gone.get(RECURRENT, 0),
        )

    # -- sizes ----------------------------------------------------------------------------------
    def _component(self, name: str) -> CacheComponent:
        for c in self.components:
            if c.name == name:
                return c
        raise ValueError(f"component {name!r} is not in this cache's {self.component_names}")

    def evictable_size(self, component: str = "full") -> int:
        """Unlocked tokens (snapshots for 'recurrent') the tree could evict."""
        return self._component(component).evictable

    def protected_size(self, component: str = "full") -> int:
        """Locked tokens (snapshots for 'recurrent')."""
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
        """Raise AssertionError unless the tree and its ledgers are consistent (see invariants)."""
        from hyloop.cache.invariants import check_cache

        check_cache(
            self, request_held_tokens, pending_free_tokens, request_held_slots, pending_free_slots
        )
