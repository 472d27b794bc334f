"""``check_invariants`` for the UHRC: a full recomputation, meant for tests and debug runs.

Ledgers: free + pending-free + request-held + tree-held == capacity, for KV tokens and (with the
RECURRENT component) for state slots. "Pending-free" is what was freed while a launched step may
still read it; with the defaults (0) nothing is outside the tree: free + tree == capacity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hyloop.cache.node import FULL, RECURRENT, SWA, TreeNode

if TYPE_CHECKING:
    from hyloop.cache.tree import UnifiedRadixCache


def _walk_nodes(cache: UnifiedRadixCache) -> list[TreeNode]:
    """All non-root nodes, checking the parent/child links and key shape on the way."""
    ps = cache.page_size
    nodes: list[TreeNode] = []
    stack = [cache.root]
    while stack:
        parent = stack.pop()
        for ck, child in parent.children.items():
            if child.parent is not parent or child.child_key != ck or not child.alive:
                raise AssertionError(f"tree: node {child.id} is filed wrongly under {parent.id}")
            if not child.length or child.length % ps or len(child.key) != child.length * 8:
                raise AssertionError(
                    f"tree: node {child.id} has {child.length} tokens; expected a positive "
                    f"multiple of page_size {ps}"
                )
            plain = child.key[: ps * 8]
            if (ck[1] if parent.parent is None else ck) != plain:
                raise AssertionError(f"tree: node {child.id} child key {ck!r} != its first page")
            if child.depth != parent.depth + child.length:
                raise AssertionError(f"tree: node {child.id} depth {child.depth} is inconsistent")
            nodes.append(child)
            stack.append(child)
    return nodes


def _check_locks(cache: UnifiedRadixCache, nodes: list[TreeNode]) -> None:
    """Every lock_ref equals what the outstanding receipts account for."""
    for c in cache.components:
        counts: dict[int, int] = {}
        for receipt, tokens in cache._receipts.values():
            if not receipt.node.alive:
                raise AssertionError(f"locks: receipt {receipt.receipt_id} is on a removed node")
            c.expected_locks(receipt.node, tokens[c.kind], counts)
        for node in nodes:
            got = node.component_data[c.kind].lock_ref
            want = counts.get(node.id, 0)
            if got != want:
                raise AssertionError(
                    f"locks: node {node.id} {c.name} lock_ref {got}, receipts account for {want}"
                )


def _check_kv_ledger(
    cache: UnifiedRadixCache, nodes: list[TreeNode], request_held: int, pending_free: int
) -> None:
    alloc = cache.kv_allocator
    values = [n.component_data[FULL].value for n in nodes]
    held = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
    if held.numel() != torch.unique(held).numel():
        raise AssertionError("kv ledger: a KV slot is held by two tree nodes")
    ps = cache.page_size
    pages = torch.unique(held // ps).numpy()
    if len(pages) * ps != held.numel():
        raise AssertionError("kv ledger: tree nodes hold partial pages")
    both = pages[alloc.is_free_page(pages)]  # the free bitmap: no set of the whole free list
    if len(both):
        raise AssertionError(f"kv ledger: pages {both[:8].tolist()} are both free and in the tree")
    total = alloc.available_size() + pending_free + request_held + held.numel()
    if total != alloc.capacity:
        raise AssertionError(
            f"kv ledger: free {alloc.available_size()} + pending-free {pending_free} + "
            f"request-held {request_held} + tree {held.numel()} = {total}, "
            f"capacity {alloc.capacity}"
        )
    if cache.full.evictable + cache.full.protected != held.numel():
        raise AssertionError("kv ledger: evictable + protected != tokens held by the tree")


def _check_swa_pool(cache: UnifiedRadixCache, nodes: list[TreeNode]) -> None:
    """SWA with a pool of its own: its slots held once, in whole pages, none of them free.
    (The pool's ledger with the requests' windows is the engine's: ``SWAWindows.check``.)"""
    swa = cache.swa
    if swa is None or swa.allocator is None:
        return
    values = [n.component_data[SWA].value for n in nodes]
    values = [v for v in values if v is not None]
    held = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
    if held.numel() != torch.unique(held).numel():
        raise AssertionError("swa ledger: a window-pool slot is held by two tree nodes")
    ps = cache.page_size
    pages = torch.unique(held // ps).numpy()
    if len(pages) * ps != held.numel():
        raise AssertionError("swa ledger: tree nodes hold partial window-pool pages")
    both = pages[swa.allocator.is_free_page(pages)]
    if len(both):
        raise AssertionError(f"swa ledger: pages {both[:8].tolist()} are free and in the tree")
    if swa.evictable + swa.protected != held.numel():
        raise AssertionError("swa ledger: evictable + protected != tokens held by the tree")


def _check_slot_ledger(
    cache: UnifiedRadixCache, nodes: list[TreeNode], request_held: int, pending_free: int
) -> None:
    rec = cache.recurrent
    if rec is None:
        return
    alloc = rec.allocator
    held = [n.component_data[RECURRENT].value for n in nodes]
    held = [s for s in held if s is not None]
    if len(set(held)) != len(held):
        raise AssertionError("slot ledger: a snapshot slot is held by two nodes")
    total = alloc.available_size() + pending_free + request_held + len(held)
    if total != alloc.capacity:
        raise AssertionError(
            f"slot ledger: free {alloc.available_size()} + pending-free {pending_free} + "
            f"request-held {request_held} + tree {len(held)} = {total}, "
            f"capacity {alloc.capacity}"
        )


def check_cache(
    cache: UnifiedRadixCache,
    request_held_tokens: int = 0,
    pending_free_tokens: int = 0,
    request_held_slots: int = 0,
    pending_free_slots: int = 0,
) -> None:
    root = cache.root
    if root.component_data[FULL].lock_ref != 1 or root.parent is not None:
        raise AssertionError("tree: the root must be parentless with lock_ref 1")
    nodes = _walk_nodes(cache)
    leaves = {n for n in nodes if not n.children}
    if leaves != cache.leaves:
        raise AssertionError(
            f"tree: leaf set drifted ({len(cache.leaves)} tracked, {len(leaves)} actual)"
        )
    for c in cache.components:
        c.check(nodes)
    _check_locks(cache, nodes)
    _check_kv_ledger(cache, nodes, request_held_tokens, pending_free_tokens)
    _check_swa_pool(cache, nodes)
    _check_slot_ledger(cache, nodes, request_held_slots, pending_free_slots)
    if cache._kv_to_free or cache._swa_to_free or cache._slots_to_free:
        raise AssertionError("tree: frees are queued outside an operation")
