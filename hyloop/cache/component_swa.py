"""SWA component: sliding-window KV, reusable only where the last ``window`` tokens are present
(a tombstone marks a node's window-layer entries as not reusable: a hit needs the ``window``
tokens before it all present, or the root).

Two layouts. Without an allocator of its own every layer shares the KV pool's slots, so a node's
SWA value is its FULL slots and tombstoning frees nothing. With one (the window layers' own pool,
as the engine builds it) the value is that pool's slots: an insert hands them in
(``InsertParams.swa_value``, valid from ``swa_from``); this component keeps the window before the
insert's end (a node of its own), fills window-less nodes from ``swa_from`` on, says which slots
it took (``InsertResult.swa_taken``), and tombstoning frees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hyloop.cache.component_base import CacheComponent, ComponentHost, check_pages
from hyloop.cache.lru import LRUList
from hyloop.cache.node import FULL, SWA, TreeNode
from hyloop.cache.params import InsertParams
from hyloop.pools.page_allocator import PageAllocator

# Run length standing for "no tombstone between the root and here".
_FROM_ROOT = 1 << 62


@dataclass
class _Fill:
    """One insert's window-pool slots: window-less nodes are filled from ``start``, new ones
    from ``keep`` (the window before the insert's ``end``)."""

    value: torch.Tensor
    start: int
    keep: int
    end: int
    taken: list[tuple[int, int]] = field(default_factory=list)


class SWAComponent(CacheComponent):
    """Window-limited hits, locks and LRU refresh; internal nodes are tombstoned on eviction."""

    kind = SWA
    name = "swa"
    priority = 1
    evict_param = "swa_num_tokens"
    evicted_field = "swa_num_tokens_evicted"

    def __init__(
        self,
        cache: ComponentHost,
        window: int,
        allocator: PageAllocator | None = None,
        page_size: int = 1,
        lock_granule: int | None = None,
    ) -> None:
        super().__init__(cache)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window must be an int >= 1, got {window!r}")
        if lock_granule is not None and (lock_granule < 1 or lock_granule % page_size):
            raise ValueError(f"swa lock_granule {lock_granule}: not a multiple of {page_size}")
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"swa_allocator page_size {allocator.page_size} != {page_size}")
        self.window = window
        self.page_size = page_size
        self.allocator = allocator  # the window layers' own pool, or None (shared slots)
        # A lock splits the window it pins into nodes of at most this many tokens (None: only
        # where it starts), so a reader's window slides on releasing all but one granule behind
        # it (``unlock_before``).
        self.lock_granule = lock_granule
        self.lru = LRUList()

    # -- match ----------------------------------------------------------------------------------
    def hit_context(self, path: list[TreeNode]) -> list[int]:
        """For each path node, the SWA-present run of tokens just before it."""
        runs = []
        run = _FROM_ROOT
        for node in path:
            runs.append(run)
            run = 0 if node.component_data[SWA].value is None else run + node.length
        return runs

    def hits_at(self, ctx: list[int], path: list[TreeNode], i: int, m: int) -> bool:
        if m == 0:
            if i == 0:
                return True
            i -= 1
            m = path[i].length
        if path[i].component_data[SWA].value is None:
            return False
        return ctx[i] + m >= self.window

    def _window_nodes(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and the ancestors that the ``window`` tokens ending at it reach into."""
        out = []
        covered = 0
        while node.parent is not None and covered < self.window:
            out.append(node)
            covered += node.length
            node = node.parent
        return out

    def on_match(self, node: TreeNode, stamp: int) -> None:
        # Only the window before the hit is reusable, so only it is refreshed; the deepest node
        # goes in last and ends up most recent.
        for n in reversed(self._window_nodes(node)):
            cd = n.component_data[SWA]
            if cd.value is not None:
                self.lru.push_mru(cd, stamp)

    # -- structure ------------------------------------------------------------------------------
    def _set(self, node: TreeNode, stamp: int, value: torch.Tensor | None = None) -> None:
        cd = node.component_data[SWA]
        cd.value = node.component_data[FULL].value if value is None else value
        if cd.lock_ref:
            self.protected += node.length
        else:
            self.evictable += node.length
        self.lru.push_mru(cd, stamp)

    def on_new_node(self, node: TreeNode, stamp: int) -> None:
        if self.allocator is None:  # own pool: a tombstone until the core fills it
            self._set(node, stamp)

    # -- insert ---------------------------------------------------------------------------------
    def begin_insert(self, params: InsertParams, aligned: int) -> _Fill | None:
        if self.allocator is None or params.swa_value is None:
            return None
        if params.swa_value.dim() != 1 or len(params.swa_value) != len(params.key):
            raise ValueError(
                f"insert: swa_value must be a 1-D tensor with one index per token "
                f"({len(params.key)}), got {tuple(params.swa_value.shape)}"
            )
        ps = self.page_size
        start = min(aligned, -(-max(0, params.swa_from) // ps) * ps)
        keep = max(start, (aligned - self.window) // ps * ps)
        return _Fill(params.swa_value, start, min(aligned, keep), aligned)

    def overlap_cut(self, node: TreeNode, state: _Fill | None) -> int | None:
        """Fill a window-less node from ``state.start``: the part before it stays as it is."""
        windowless = state is not None and node.component_data[SWA].value is None
        if windowless and node.start_depth < state.start < node.depth:
            return state.start
        return None

    def on_insert_overlap(self, node: TreeNode, state: _Fill | None, stamp: int) -> None:
        if node.component_data[SWA].value is not None:
            return
        if self.allocator is None:  # the inserting request just computed these, window included
            self._set(node, stamp)
        elif state is not None and node.start_depth >= state.start:
            self._fill(node, state, stamp)

    def new_leaf_cuts(self, start: int, end: int, state: _Fill | None) -> list[int]:
        """The window before the insert's end gets a node of its own."""
        return [state.keep] if state is not None and start < state.keep < end else []

    def on_new_leaf(self, node: TreeNode, state: _Fill | None, stamp: int) -> None:
        if state is not None and state.keep < state.end and node.start_depth >= state.keep:
            self._fill(node, state, stamp)

    def finish_insert(
        self, node: TreeNode, state: _Fill | None, stamp: int, whole: bool
    ) -> dict[str, Any]:
        return {"swa_taken": tuple(state.taken)} if state is not None else {}

    def _fill(self, node: TreeNode, state: _Fill, stamp: int) -> None:
        """Own pool: give window-less ``node`` the pool's slots of its tokens."""
        a, b = node.start_depth, node.depth
        self._set(node, stamp, state.value[a:b].to(dtype=torch.int64, copy=True))
        if state.taken and state.taken[-1][1] == a:
            state.taken[-1] = (state.taken[-1][0], b)
        else:
            state.taken.append((a, b))

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        src = lower.component_data[SWA]
        dst = upper.component_data[SWA]
        dst.lock_ref = src.lock_ref
        if src.value is not None:
            if self.allocator is None:
                src.value = lower.component_data[FULL].value
                dst.value = upper.component_data[FULL].value
            else:
                dst.value, src.value = src.value[: upper.length], src.value[upper.length :]
            self.lru.insert_after(src, dst)

    def drop(self, node: TreeNode) -> int:
        """Tombstone ``node``'s SWA data (unlocked); returns the tokens dropped."""
        cd = node.component_data[SWA]
        if cd.value is None:
            return 0
        self.lru.remove(cd)
        if self.allocator is not None:
            self.cache.queue_free(SWA, cd.value)
        cd.value = None
        self.evictable -= node.length
        return node.length

    def free(self, items: list[torch.Tensor]) -> None:
        assert self.allocator is not None
        self.allocator.free(torch.cat(items))

    # -- locks ----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> int:
        """Lock the window ending at ``node``; returns the token depth where the lock starts.

        NOTE: the receipt keeps a depth, not a boundary node, so a later split of the boundary
        node (both halves inherit its lock_ref) is released exactly.
        """
        start = node.depth
        for n in self._window_nodes(node):
            cd = n.component_data[SWA]
            if cd.lock_ref == 0 and cd.value is not None:
                self.evictable -= n.length
                self.protected += n.length
            cd.lock_ref += 1
            start = n.start_depth
        return start

    def receipt_fields(self, token: Any) -> dict[str, Any]:
        return {"swa_start_depth": token}

    @staticmethod
    def _pinned_nodes(node: TreeNode, token: object) -> list[TreeNode]:
        """The nodes a lock at ``node`` that starts at depth ``token`` pins, deepest first."""
        assert isinstance(token, int)
        out = []
        while node.parent is not None and node.depth > token:
            out.append(node)
            node = node.parent
        return out

    def _unref(self, node: TreeNode) -> None:
        cd = node.component_data[SWA]
        cd.lock_ref -= 1
        if cd.lock_ref == 0 and cd.value is not None:
            self.evictable += node.length
            self.protected -= node.length

    def unlock(self, node: TreeNode, token: object) -> None:
        for n in self._pinned_nodes(node, token):
            self._unref(n)

    def expected_locks(self, node: TreeNode, token: object, counts: dict[int, int]) -> None:
        for n in self._pinned_nodes(node, token):
            counts[n.id] = counts.get(n.id, 0) + 1

    def lock_cuts(self, node: TreeNode) -> list[int]:
        """NOTE: a lock pins exactly the window (page rounded) before ``node``, in nodes of at
        most ``lock_granule`` tokens: a whole-node lock would pin up to a node's length more
        than the request's window-pool reservation counts (``pools.swa_pool``)."""
        ps, g = self.page_size, self.lock_granule
        start = max(0, node.depth - self.window) // ps * ps
        grid = range((start // g + 1) * g, node.depth, g) if g else range(0)
        out, n = [], node
        for depth in reversed([start, *grid]):
            while n.parent is not None and n.start_depth >= depth:
                n = n.parent
            if n.parent is None:
                break
            if n.start_depth < depth < n.depth and n.component_data[SWA].value is not None:
                out.append(depth)  # only nodes holding window pages are worth a split
        return out

    def unlock_before(self, node: TreeNode, token: object, depth: int) -> int:
        assert isinstance(token, int)
        for n in reversed(self._pinned_nodes(node, token)):  # from the window's start down
            if n.depth > depth:
                break
            self._unref(n)
            token = n.depth
        return token

    def pinned(self, node: TreeNode, token: object) -> int:
        nodes = self._pinned_nodes(node, token)
        return sum(n.length for n in nodes if n.component_data[SWA].value is not None)

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, amount: int) -> int:
        return self.evict_lru(self.lru, amount, lambda node: node.length)

    # -- checks ---------------------------------------------------------------------------------
    def check(self, nodes: list[TreeNode]) -> None:
        listed = {id(cd) for cd in self.lru.check("swa")}
        evictable = protected = 0
        for node in nodes:
            cd = node.component_data[SWA]
            full_lock = node.component_data[FULL].lock_ref
            if cd.lock_ref < 0 or cd.lock_ref > full_lock:
                raise AssertionError(
                    f"swa: node {node.id} lock_ref {cd.lock_ref} outside 0..{full_lock} (full)"
                )
            if (cd.value is not None) != (id(cd) in listed):
                raise AssertionError(f"swa: node {node.id} LRU membership disagrees with value")
            if cd.value is None:
                continue
            if self.allocator is not None:
                if cd.value.numel() != node.length:
                    raise AssertionError(f"swa: node {node.id} holds {cd.value.numel()} slots")
            elif cd.value is not node.component_data[FULL].value:
                raise AssertionError(f"swa: node {node.id} SWA value is not its FULL slots")
            if cd.lock_ref:
                protected += node.length
            else:
                evictable += node.length
        if len(listed) != sum(1 for n in nodes if n.component_data[SWA].value is not None):
            raise AssertionError("swa: LRU holds nodes that are not in the tree")
        self.check_sizes(evictable, protected)

    def check_ledger(self, nodes: list[TreeNode], held: dict[str, int]) -> None:
        """A pool of its own: what the tree holds of it (the pool's ledger with the requests'
        windows is ``pools.swa_pool.SWAWindows.check``)."""
        if self.allocator is None:
            return
        values = [n.component_data[SWA].value for n in nodes]
        tree = check_pages("swa", [v for v in values if v is not None], self.allocator)
        if self.evictable + self.protected != tree:
            raise AssertionError("swa ledger: evictable + protected != tokens held by the tree")
