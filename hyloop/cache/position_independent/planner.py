"""Plan a prompt's reuse after its exact-prefix match: which positions come from a donor.

Each chunk of the unmatched tail is looked up; a candidate is used only once its tokens (row
models: its rows) equal the prompt's. A used hit is then extended left and right against the
donor's own tokens, since content-defined boundaries near a document's edges depend on the text
around it and whole-chunk hits alone lose most of a short document. Extending right may follow
the prompt down the donor's subtree; row models extend only as far as the donor's rows reach.

The plan's segments cover ``[0, len(tokens))``: the exact prefix, reused runs and computed
runs. The first ``recompute_tokens`` of each reused run are computed instead, to re-establish
its attention to what now precedes it. The planner only reads the tree; the caller locks each
reused run's ``node`` before evicting anything and releases it once the run is copied.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from hyloop.cache.key import TOKEN_BYTES
from hyloop.cache.node import FULL, TreeNode
from hyloop.cache.params import IncLockRefResult
from hyloop.cache.position_independent.chunker import fingerprint
from hyloop.cache.position_independent.index import DonorIndex, path_to, path_tokens


@dataclass(frozen=True)
class Segment:
    kind: Literal["exact", "reused", "computed"]
    start: int  # position in the prompt
    length: int
    src_start: int = -1  # reused: donor position of the first token
    node: TreeNode | None = None  # reused: lock this node (its root path holds the donor run)
    src_slots: torch.Tensor | None = None  # reused: the donor's KV slots, one per token

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def delta(self) -> int:
        return self.start - self.src_start


@dataclass(frozen=True)
class ReusePlan:
    segments: list[Segment]
    # The donors' lock receipts while admission holds the plan (``position_independent.reuse``).
    locks: list[IncLockRefResult] = field(default_factory=list)

    @property
    def reused(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "reused"]

    @property
    def reused_tokens(self) -> int:
        return sum(s.length for s in self.reused)


class _Donor:
    """A donor path's tokens (and rows, for row models), found once per plan."""

    def __init__(self, node: TreeNode, rows: np.ndarray | None) -> None:
        self.path = path_to(node)
        self.tokens = path_tokens(self.path)
        self.rows = rows

    def limit(self) -> int:
        """Donor positions extension may reach: the path, or (row models) the recorded rows."""
        return len(self.tokens) if self.rows is None else min(len(self.tokens), len(self.rows))


def _common_run(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common leading run of ``a`` and ``b`` (1-D ids, or 2-D rows compared whole)."""
    n = min(len(a), len(b))
    ne = a[:n] != b[:n]
    if ne.ndim > 1:
        ne = ne.any(axis=1)
    diff = np.flatnonzero(ne)
    return int(diff[0]) if len(diff) else n


class ReusePlanner:
    def __init__(self, index: DonorIndex, page_size: int = 1, recompute_tokens: int = 0) -> None:
        if recompute_tokens < 0:
            raise ValueError(f"recompute_tokens must be >= 0, got {recompute_tokens}")
        self.index = index
        self.page_size = page_size
        self.recompute_tokens = recompute_tokens

    def plan(
        self,
        tokens: list[int] | np.ndarray,
        cached: int,
        extra_key: Hashable = None,
        rows: np.ndarray | None = None,
    ) -> ReusePlan:
        """Segments for ``tokens`` (the prompt positions the prefill may skip) given an exact
        prefix of ``cached`` tokens; ``rows [len(tokens), C]`` for row models."""
        ids = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
        if rows is not None and len(rows) != len(ids):
            raise ValueError(f"plan: {len(rows)} rows for {len(ids)} keys")
        n = len(ids)
        lo = max(cached, self.index.chunker.params.sink_tokens)
        runs: list[tuple[int, int, int, TreeNode, _Donor]] = []  # start, end, src, node, donor
        covered = lo
        if n - lo >= self.index.chunker.params.min_chunk:
            self.index.flush()
            donors: dict[tuple[int, int], _Donor] = {}
            for start, end, _ in self.index.chunker.cuts(ids):
                if start < covered:
                    continue
                hit = self._confirm(ids, rows, start, end, extra_key, donors)
                if hit is None:
                    continue
                src, donor = hit
                run = self._extend(ids, rows, start, end, src, donor, covered)
                runs.append(run)
                covered = run[1]
        return self._segments(n, cached, runs)

    def _confirm(
        self,
        ids: np.ndarray,
        rows: np.ndarray | None,
        start: int,
        end: int,
        extra_key: Hashable,
        donors: dict[tuple[int, int], _Donor],
    ) -> tuple[int, _Donor] | None:
        chunk = ids[start:end]
        fp = fingerprint(chunk)
        for e in self.index.lookup(extra_key, fp):
            if e.end - e.start != end - start or (rows is None) != (e.rows is None):
                continue
            key = (e.anchor.id, id(e.rows))
            donor = donors.get(key)
            if donor is None:
                donor = donors[key] = _Donor(e.anchor, e.rows)
            # NOTE: a fingerprint only nominates; equal tokens (full rows) decide.
            if not np.array_equal(donor.tokens[e.start : e.end], chunk):
                continue
            if rows is not None and not np.array_equal(
                donor.rows[e.start : e.end], rows[start:end]
            ):
                continue
            return e.start, donor
        return None

    def _extend(
        self,
        ids: np.ndarray,
        rows: np.ndarray | None,
        start: int,
        end: int,
        src: int,
        donor: _Donor,
        left_limit: int,
    ) -> tuple[int, int, int, TreeNode, _Donor]:
        mine, theirs = (ids, donor.tokens) if rows is None else (rows, donor.rows)
        assert theirs is not None
        limit = donor.limit()
        # Left: back toward the previous run (or the exact prefix), while tokens agree.
        room = min(start - left_limit, src)
        k = _common_run(mine[start - room : start][::-1], theirs[src - room : src][::-1])
        start, src = start - k, src - k
        # Right: along the donor path, then (token models) down its subtree after the prompt.
        d_pos = src + (end - start)
        pos = end + _common_run(mine[end:], theirs[d_pos:limit])
        node = donor.path[-1]
        d_end = src + (pos - start)
        descended = False
        while rows is None and d_end == node.depth and pos < len(ids):
            child = self._child(node, ids, pos)
            if child is None:
                break
            m = _common_run(ids[pos:], np.frombuffer(child.key, dtype="<i8"))
            if m == 0:
                break
            donor.path.append(child)
            node, pos, d_end, descended = child, pos + m, d_end + m, True
        if descended:  # later hits on this donor see the longer path
            donor.tokens = path_tokens(donor.path)
        return start, pos, src, node, donor

    def _child(self, node: TreeNode, ids: np.ndarray, pos: int) -> TreeNode | None:
        ps = self.page_size
        if pos + ps <= len(ids):
            child = node.children.get(ids[pos : pos + ps].tobytes())
            if child is not None:
                return child
        first = ids[pos : pos + 1].tobytes()
        for child in node.children.values():
            if child.key[:TOKEN_BYTES] == first:
                return child
        return None

    def _segments(
        self, n: int, cached: int, runs: list[tuple[int, int, int, TreeNode, _Donor]]
    ) -> ReusePlan:
        segs: list[Segment] = []
        if cached:
            segs.append(Segment("exact", 0, cached))
        pos = cached
        r = self.recompute_tokens
        for start, end, src, node, donor in runs:
            start, src = start + r, src + r
            if end - start <= 0:
                continue
            if start > pos:
                segs.append(Segment("computed", pos, start - pos))
            slots = _path_slots(donor.path, node)[src : src + end - start]
            segs.append(Segment("reused", start, end - start, src, node, slots))
            pos = end
        if n > pos:
            segs.append(Segment("computed", pos, n - pos))
        return ReusePlan(segs)


def _path_slots(path: list[TreeNode], node: TreeNode) -> torch.Tensor:
    """KV slots of the path from the root down to ``node`` (which is on ``path``)."""
    upto = path.index(node) + 1
    return torch.cat([n.component_data[FULL].value for n in path[:upto]])
