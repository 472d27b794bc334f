"""The donor index: (extra_key, chunk fingerprint) -> where in the radix tree that chunk's KV lies.

An entry names a node (its *anchor*) whose root path holds the chunk at donor positions
``[start, end)``; after a split the chunk may end on an ancestor. Nodes are only removed as
leaves, so while the anchor lives every page of the chunk does. When an anchor goes, its entries
move to the parent if that still holds the whole chunk, else are dropped: no entry names a freed
page.

``note`` only records a commit so inserting stays cheap; ``flush`` fingerprints all recorded
commits in one vectorised pass before the next lookup, skipping chunks the tree held before the
insert (their inserter filed them). Hits are candidates only: the planner confirms each by
token equality. Row models key a row by a folded hash, so their entries also carry the donor's
rows ``[n, C]`` (shared by one commit's entries) for the planner to compare whole.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from hyloop.cache.key import RadixKey
from hyloop.cache.node import FULL, TreeNode
from hyloop.cache.position_independent.chunker import Chunker, fingerprint

MAX_PENDING = 256  # recorded commits fingerprinted at once when no lookup comes first


@dataclass(eq=False)
class DonorEntry:
    extra_key: Hashable
    fingerprint: int
    start: int  # donor position of the chunk's first token
    end: int  # one past its last token
    anchor: TreeNode
    rows: np.ndarray | None = None  # row models: the donor's rows [n, C] from position 0


def live_anchor(node: TreeNode) -> TreeNode:
    """``node`` or, if the tree removed it, its deepest ancestor still in the tree."""
    while not node.alive:
        assert node.parent is not None, "the root is never removed"
        node = node.parent
    return node


def path_to(node: TreeNode) -> list[TreeNode]:
    """Nodes from the root's child down to ``node``."""
    path: list[TreeNode] = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def path_tokens(path: list[TreeNode]) -> np.ndarray:
    return np.frombuffer(b"".join(n.key for n in path), dtype="<i8")


class DonorIndex:
    """``force_collisions`` (tests only) files every chunk under fingerprint 0, so every lookup
    returns every donor and only the token check stands between a hit and a false match."""

    def __init__(
        self, chunker: Chunker, max_donors_per_key: int = 4, force_collisions: bool = False
    ) -> None:
        if max_donors_per_key < 1:
            raise ValueError(f"max_donors_per_key must be >= 1, got {max_donors_per_key}")
        self.chunker = chunker
        self.max_donors_per_key = max_donors_per_key
        self.force_collisions = force_collisions
        self._by_key: dict[tuple[Hashable, int], list[DonorEntry]] = {}
        self._by_anchor: dict[int, list[DonorEntry]] = {}
        self._pending: list[tuple[RadixKey, int, int, TreeNode, np.ndarray | None]] = []

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    # -- registration ---------------------------------------------------------------------------
    def note(
        self,
        key: RadixKey,
        num_tokens: int,
        last_node: TreeNode,
        held_before: int = 0,
        rows: np.ndarray | None = None,
    ) -> None:
        """The tree holds ``key[:num_tokens]`` on the path to ``last_node`` (``key[:held_before]``
        already before this commit); ``rows`` for row models."""
        if num_tokens - max(held_before, self.chunker.params.sink_tokens) > 0:
            self._pending.append((key, num_tokens, held_before, last_node, rows))
            if len(self._pending) >= MAX_PENDING:
                self.flush()

    def flush(self) -> None:
        """Fingerprint every recorded commit."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        nodes = [live_anchor(p[3]) for p in pending]
        # a removed tail takes its chunks with it
        seqs = [
            np.frombuffer(p[0].packed, dtype="<i8", count=min(p[1], node.depth))
            for p, node in zip(pending, nodes, strict=True)
        ]
        all_cuts = self.chunker.cuts_many(seqs)
        for p, node, ids, cuts in zip(pending, nodes, seqs, all_cuts, strict=True):
            key, held_before, rows = p[0].extra_key, p[2], p[4]
            # Walk up from the deepest node; each chunk is anchored on the node holding its end.
            for start, end, closed in reversed(cuts):
                if end <= held_before:
                    break
                if not closed:
                    continue
                while node.start_depth >= end:
                    assert node.parent is not None
                    node = node.parent
                fp = 0 if self.force_collisions else fingerprint(ids[start:end])
                self._add(DonorEntry(key, fp, start, end, node, rows))

    def _add(self, entry: DonorEntry) -> None:
        bucket = self._by_key.setdefault((entry.extra_key, entry.fingerprint), [])
        for e in bucket:
            if e.anchor is entry.anchor and e.start == entry.start and e.end == entry.end:
                return  # the same chunk of the same path (a re-commit)
        if len(bucket) >= self.max_donors_per_key:
            self._unlink(bucket.pop(0))  # the oldest donor gives way
        bucket.append(entry)
        self._by_anchor.setdefault(entry.anchor.id, []).append(entry)

    def _unlink(self, entry: DonorEntry) -> None:
        anchored = self._by_anchor[entry.anchor.id]
        anchored.remove(entry)
        if not anchored:
            del self._by_anchor[entry.anchor.id]

    # -- lookup ---------------------------------------------------------------------------------
    def lookup(self, extra_key: Hashable, fp: int) -> list[DonorEntry]:
        """Candidate donors, newest first (unconfirmed: compare tokens before use)."""
        if self.force_collisions:
            fp = 0
        return list(reversed(self._by_key.get((extra_key, fp), ())))

    # -- tree events ----------------------------------------------------------------------------
    def on_node_deleted(self, node: TreeNode) -> None:
        """The tree removed ``node`` (a leaf): move its entries up, or drop them."""
        entries = self._by_anchor.pop(node.id, None)
        if not entries:
            return
        parent = node.parent
        assert parent is not None
        for e in entries:
            if parent.parent is not None and e.end <= parent.depth:
                e.anchor = parent
                self._by_anchor.setdefault(parent.id, []).append(e)
            else:
                bucket = self._by_key[(e.extra_key, e.fingerprint)]
                bucket.remove(e)
                if not bucket:
                    del self._by_key[(e.extra_key, e.fingerprint)]

    def clear(self) -> None:
        self._by_key.clear()
        self._by_anchor.clear()
        self._pending.clear()

    # -- checks ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless every entry names live pages holding its chunk."""
        seen = 0
        for (extra_key, fp), bucket in self._by_key.items():
            if not bucket or len(bucket) > self.max_donors_per_key:
                raise AssertionError(f"index: bucket {fp:#x} holds {len(bucket)} entries")
            for e in bucket:
                seen += 1
                a = e.anchor
                if not a.alive or a.component_data[FULL].value is None:
                    raise AssertionError(
                        f"index: entry {e.start}:{e.end} names removed node {a.id}"
                    )
                if not 0 <= e.start < e.end <= a.depth:
                    raise AssertionError(
                        f"index: entry {e.start}:{e.end} lies outside node {a.id}'s path "
                        f"(depth {a.depth})"
                    )
                if (e.extra_key, e.fingerprint) != (extra_key, fp):
                    raise AssertionError(f"index: entry {e.start}:{e.end} is filed wrongly")
                path = path_to(a)
                if path[0].child_key[0] != extra_key:
                    raise AssertionError(f"index: entry {e.start}:{e.end} crosses tenants")
                want = (
                    0 if self.force_collisions else fingerprint(path_tokens(path)[e.start : e.end])
                )
                if want != fp:
                    raise AssertionError(f"index: entry {e.start}:{e.end} fingerprint is stale")
                if e.rows is not None and len(e.rows) < e.end:
                    raise AssertionError(f"index: entry {e.start}:{e.end} has too few rows")
                if e not in self._by_anchor.get(a.id, ()):
                    raise AssertionError(f"index: entry {e.start}:{e.end} missing from node {a.id}")
        anchored = sum(len(v) for v in self._by_anchor.values())
        if anchored != seen:
            raise AssertionError(f"index: {anchored} anchored entries, {seen} filed")
