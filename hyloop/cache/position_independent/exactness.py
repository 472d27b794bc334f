"""Exact and approximate KV kept apart in the tree: a ``TreeHook`` over ``TreeNode.approximate``.

KV reused at another offset, and all computed after it, is approximate: it is not what a
prefill of its path computes. An insert marks it (``InsertParams.approximate_from``, rounded
down to a page: a page is exact only when all of it is), and the mark passes to both halves of
a split. NOTE: an exact-prefix match never walks into approximate KV (only a request re-reading
its own insert asks for it, ``MatchPrefixParams.approximate``), and an insert of exact KV stops
before an approximate node instead of joining it (the caller keeps its exact KV).
"""

from __future__ import annotations

from hyloop.cache.component_base import TreeHook
from hyloop.cache.node import TreeNode
from hyloop.cache.params import InsertParams, MatchPrefixParams


class ApproximateKV(TreeHook):
    """Marks approximate KV on insert; keeps matches and exact inserts out of it."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def serves(self, node: TreeNode, params: MatchPrefixParams) -> bool:
        return params.approximate or not node.approximate

    def begin_insert(self, params: InsertParams, aligned: int) -> int:
        """The first depth of the insert whose KV is approximate (``aligned``: none)."""
        start = aligned if params.approximate_from is None else params.approximate_from
        return start - start % self.page_size

    def joins(self, node: TreeNode, state: int) -> bool:
        return not node.approximate or state <= node.start_depth

    def new_leaf_cuts(self, start: int, end: int, state: int) -> list[int]:
        return [state] if start < state < end else []

    def on_new_leaf(self, node: TreeNode, state: int, stamp: int) -> None:
        node.approximate = node.start_depth >= state

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        upper.approximate = lower.approximate

    def check(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            parent = node.parent
            if parent is not None and parent.approximate and not node.approximate:
                raise AssertionError(
                    f"tree: node {node.id} is marked exact below approximate node {parent.id}"
                )
