"""``check_invariants`` for the UHRC: a full recomputation, meant for tests and debug runs.

Each component's ``check_ledger`` checks free + pending-free + request-held + tree-held ==
capacity for what it holds (KV tokens, state slots). "Pending-free" was freed while a launched
step may still read it; with the defaults (0), free + tree == capacity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hyloop.cache.node import TreeNode

if TYPE_CHECKING:
    from hyloop.cache.tree import RadixTree as UnifiedRadixCache


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


def check_cache(cache: UnifiedRadixCache, held: dict[str, int]) -> None:
    """``held``: ``request_held_tokens``, ``pending_free_tokens``, ``request_held_slots`` and
    ``pending_free_slots`` (what requests hold and what waits on a launched step)."""
    root = cache.root
    if root.component_data[0].lock_ref != 1 or root.parent is not None:
        raise AssertionError("tree: the root must be parentless with lock_ref 1")
    nodes = _walk_nodes(cache)
    leaves = {n for n in nodes if not n.children}
    if leaves != cache.leaves:
        raise AssertionError(
            f"tree: leaf set drifted ({len(cache.leaves)} tracked, {len(leaves)} actual)"
        )
    for h in [*cache.components, *cache.marks]:
        h.check(nodes)
    _check_locks(cache, nodes)
    for c in cache.components:
        c.check_ledger(nodes, held)
    if any(cache._to_free.values()):
        raise AssertionError("tree: frees are queued outside an operation")
