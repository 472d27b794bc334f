"""The UHRC tree core: one radix tree over token keys, shared by the cache components. It owns
the tree shape and the FULL KV indices and names no other component or mark: where a component
hits, what its locks pin, how an insert splits and fills its data, how it evicts, and which nodes
a match may walk into or an insert join, are hooks (``component_base``); frees are queued per
component and handed back to each. Keys are matched and split at page multiples.
``lease.RequestCache`` drives it; ``peek_prefix_len`` probes without side effects."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from hyloop.cache.component_base import CacheComponent, TreeHook
from hyloop.cache.component_full import FullComponent
from hyloop.cache.key import TOKEN_BYTES, RadixKey, page_match_bytes
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


class RadixTree:
    """Token keys -> KV slot indices, plus what the auxiliary components keep: a
    prefix cache for callers, a ``ComponentHost`` for components (``UnifiedRadixCache``
    builds it from component names)."""

    reuses_prefixes: ClassVar[bool] = True

    def __init__(
        self,
        kv_allocator: PageAllocator,
        page_size: int,
        aux: list[CacheComponent],
        marks: Sequence[TreeHook] = (),
    ) -> None:
        self.kv_allocator = kv_allocator
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self.root = TreeNode(b"", None, None, 0)
        self.root.component_data[FULL].value = torch.empty(0, dtype=torch.int64)
        self.root.component_data[FULL].lock_ref = 1  # the root is never evicted
        self.leaves: set[TreeNode] = set()
        self._stamp = 0
        self._receipt_ids = itertools.count(1)
        # receipt id -> (receipt, what each component's lock returned, by component kind)
        self._receipts: dict[int, tuple[IncLockRefResult, dict[int, Any]]] = {}
        # Told of every node the tree removes (indexes over its nodes kept elsewhere).
        self.delete_listeners: list[Callable[[TreeNode], None]] = []
        self.full = FullComponent(self, kv_allocator)
        for c in aux:
            c.cache = self
        self.aux = aux
        self.components: list[CacheComponent] = [self.full, *aux]
        self.marks = list(marks)  # hooks that keep no component data
        self.hooks: list[TreeHook] = [*aux, *self.marks]  # what a walk or an insert asks
        self._by_kind = {c.kind: c for c in self.components}
        self._to_free: dict[int, list[Any]] = {c.kind: [] for c in self.components}
        self._evict_order = sorted(self.components, key=lambda c: c.priority)
        self.component_names = tuple(c.name for c in self.components)

    def _tick(self) -> int:
        self._stamp += 1
        return self._stamp

    def _walk(self, params: MatchPrefixParams) -> tuple[list[TreeNode], int]:
        """Nodes the key matches from the root (as far as every hook lets it walk), and how many
        tokens into the last one the match ends inside it (0: on a boundary). Read-only."""
        key = params.key
        tokens = key.packed
        pb = self._page_bytes
        n = len(tokens)
        path: list[TreeNode] = []
        if n < pb:
            return path, 0
        child = self.root.children.get((key.extra_key, tokens[:pb]))
        pos = 0
        while child is not None and all(h.serves(child, params) for h in self.hooks):
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
        node.start_depth += m
        parent.children[node.child_key] = upper
        value = node.component_data[FULL].value
        upper.component_data[FULL].value = value[:m]
        node.component_data[FULL].value = value[m:]
        node.key = node.key[mb:]
        node.length -= m
        node.child_key = node.key[: self._page_bytes]
        node.parent = upper
        upper.children[node.child_key] = node
        for h in [*self.components, *self.marks]:
            h.on_split(upper, node)
        return upper

    def _add_leaf(
        self, parent: TreeNode, extra_key: Any, key: bytes, value: torch.Tensor, stamp: int
    ) -> TreeNode:
        ck: Any = key[: self._page_bytes]
        ck = (extra_key, ck) if parent.parent is None else ck
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

    def _flush_frees(self) -> None:
        for kind, items in self._to_free.items():
            if items:
                queued, self._to_free[kind] = items, []
                self._by_kind[kind].free(queued)

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

    def queue_free(self, kind: int, items: Any) -> None:
        self._to_free[kind].append(items)

    # -- match ----------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest prefix of ``params.key`` every component can serve; splits the node the hit
        ends in (at a page multiple) and refreshes each component's LRU."""
        path, partial = self._walk(params)
        full_len = path[-1].start_depth + partial if partial else (path[-1].depth if path else 0)
        i, m = self._select_hit(path, partial, params.full_only)
        nodes = path[:i] + ([self._split(path[i], m)] if m else [])
        node = nodes[-1] if nodes else self.root
        stamp = self._tick()
        for c in self.components:
            c.on_match(node, stamp)
        # FULL's part of the result (the prefix and its slots) is the core's; the others add theirs
        fields = {k: v for c in self.aux for k, v in c.match_fields(node).items()}
        return MatchResult(
            prefix_len=node.depth,
            last_node=node,
            best_match_node=node,
            full_prefix_len=full_len,
            device_indices=torch.cat([n.component_data[FULL].value for n in (self.root, *nodes)]),
            **fields,
        )

    def peek_prefix_len(self, key: RadixKey) -> int:
        """What ``match_prefix`` would return as ``prefix_len``, read-only: no split, no LRU."""
        path, partial = self._walk(MatchPrefixParams(key))
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
            raise ValueError(f"insert: value: 1-D, one index per token ({ntok}); got {got}")
        pb = self._page_bytes
        n = ntok - ntok % self.page_size
        nb = n * TOKEN_BYTES
        stamp = self._tick()
        aux = [(h, h.begin_insert(params, n)) for h in self.hooks]
        node = self.root
        pos = 0  # bytes
        overlap: list[torch.Tensor] = []
        while pos < nb:
            ck = tokens[pos : pos + pb]
            child = node.children.get((key.extra_key, ck) if node is self.root else ck)
            if child is None:
                break
            if not all(h.joins(child, state) for h, state in aux):
                n, nb = pos // TOKEN_BYTES, pos  # the tree takes nothing from here on
                break
            m = page_match_bytes(child.key, tokens, pos, pb)
            if m < len(child.key):
                child = self._split(child, m // TOKEN_BYTES)
            for c, state in aux:
                cut = c.overlap_cut(child, state)
                if cut is not None:
                    child = self._split(child, cut - child.start_depth)
            child.component_data[FULL].last_access = stamp
            for c, state in aux:
                c.on_insert_overlap(child, state, stamp)
            overlap.append(child.component_data[FULL].value)
            pos += len(child.key)
            node = child
        prefix_len = pos // TOKEN_BYTES
        if pos < nb:
            cuts = {d for c, state in aux for d in c.new_leaf_cuts(prefix_len, n, state)}
            start = prefix_len
            for end in sorted(cuts | {n}):
                own = value[start:end].to(dtype=torch.int64, copy=True)
                segment = tokens[start * TOKEN_BYTES : end * TOKEN_BYTES]
                node = self._add_leaf(node, key.extra_key, segment, own, stamp)
                for c, state in aux:
                    c.on_new_leaf(node, state, stamp)
                start = end
        else:
            self.full.note_leaf(node)
        num_freed = self.full.free_duplicates(value, overlap, prefix_len) if prefix_len else 0
        fields: dict[str, Any] = {"aligned_len": n, "last_node": node, "num_freed": num_freed}
        for c, state in aux:
            fields.update(c.finish_insert(node, state, stamp, n == ntok and n > 0))
        self._flush_frees()
        return InsertResult(prefix_len=prefix_len, **fields)

    # -- locks ----------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """Pin what a request at ``node`` reads (splitting the path where a component's lock
        starts or ends: ``lock_cuts``); release by handing back the receipt."""
        if not isinstance(node, TreeNode) or not node.alive:
            raise ValueError(f"inc_lock_ref: {node!r} is not a live node of this tree")
        for depth in (d for c in self.aux for d in c.lock_cuts(node)):
            upper = node
            while upper.start_depth >= depth:
                upper = upper.parent
            if upper.start_depth < depth < upper.depth:
                self._split(upper, depth - upper.start_depth)
        tokens = {c.kind: c.lock(node) for c in self.components}
        fields = {k: v for c in self.aux for k, v in c.receipt_fields(tokens[c.kind]).items()}
        rid = next(self._receipt_ids)
        receipt = IncLockRefResult(receipt_id=rid, node=node, delta=tokens[FULL], **fields)
        self._receipts[rid] = (receipt, tokens)
        return receipt

    def dec_lock_ref(self, params: DecLockRefParams | IncLockRefResult) -> DecLockRefResult:
        """Release the lock a receipt stands for; a double or foreign release raises and
        changes nothing."""
        if isinstance(params, IncLockRefResult):
            params = DecLockRefParams(receipt_id=params.receipt_id, node_id=params.node.id)
        entry = self._receipts.get(params.receipt_id)
        if entry is None:
            msg = "is not outstanding (already released, or not issued by this cache)"
            raise ValueError(f"dec_lock_ref: receipt {params.receipt_id} {msg}")
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
        """Cascade from low to high priority (``CacheComponent.priority``), each in its LRU
        order; locked data stays."""
        gone = {c.evicted_field: c.evictable + c.protected for c in self.components}
        for c in self._evict_order:
            amount = getattr(params, c.evict_param)
            if amount > 0:
                c.evict(amount)
        self._flush_frees()
        for c in self.components:
            gone[c.evicted_field] -= c.evictable + c.protected
        return EvictResult(**gone)
