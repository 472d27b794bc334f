"""The request side of the cache: what a running request holds, from admission to release.

A lease's KV row, by position (``Lease.slots``, mirrored in its req->token row)::

    [0, own_from)            the tree's pages: the prefix hit, and what later commits handed
                             over; read under ``lock``
    [own_from, len(slots))   the request's own pages, reserved at admission for its whole
                             prompt and its max new tokens

plus, on hybrid models, one working state slot, and on sliding-window models its window pages
(``lease_windows``). Every page and slot a request touches passes through here, so the ledger
(free + pending-free + request-held + tree-held == capacity) has one place to be right. Frees
follow the pools' ``StepFence``: what a launched step may still read waits for it. The scheduler
calls down (and probes with ``cached_len``):

1. ``admit``: match the prompt, lock the hit, reserve the rest (evicting unlocked tree data when
   short), take a req->token row and a working state slot and, on a recurrent hit, copy the
   node's snapshot into it while the node is locked. With position-independent reuse
   (``Reuse``), the unmatched tail is planned too: each reused run's donor is locked before
   anything is evicted and its KV moved into the request's pages before release. The match
   serves exact KV only; reused KV, and all computed after it, is committed as approximate.
2. ``commit``: as prefill chunks complete (and at track boundaries for hybrid models), insert
   the computed prefix; the tree takes its page-aligned part, the lease re-points duplicate
   positions at the tree's pages and moves its lock to the new node.
3. ``release``: on finish, commit the whole computed sequence (with the end state snapshot when
   it is page aligned), unlock and free what the tree did not take; on abort, free only.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hyloop.cache.key import RadixKey
from hyloop.cache.lease_windows import LeaseWindows, NoWindows
from hyloop.cache.params import (
    EvictParams,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
)
from hyloop.pools import PageAllocator, RecurrentPool, ReqToTokenPool, SlotRole, SWAWindows

if TYPE_CHECKING:
    from hyloop.cache.unified import UnifiedRadixCache


class Holder(Protocol):
    """What the cache reads of a request (``framework.requests.Request``)."""

    request_id: str
    prompt_ids: list[int]
    max_new: int
    output_ids: list[int]
    reads_cache: bool  # False: computes its whole prompt (it wants the prompt's logprobs)
    extra_key: Hashable  # its namespace in the tree (a prompt's cache_salt)

    @property
    def total_len(self) -> int: ...


class Reuse(Protocol):
    """Position-independent reuse of a prompt's unmatched tail (``position_independent``):
    ``plan`` locks the donors of the runs it reuses (None: no run); ``realise`` copies their KV
    into the lease's pages, records the reused spans and unlocks them; ``drop`` only unlocks."""

    def plan(self, req: Any, cached: int) -> Any: ...

    def drop(self, plan: Any) -> None: ...

    def realise(self, plan: Any, lease: Lease) -> None: ...

    def note(self, req: Any, key: RadixKey, result: InsertResult) -> None: ...

    def check(self) -> None: ...


@dataclass
class Lease:
    slots: torch.Tensor  # KV slots of positions 0..len(slots)-1
    own_from: int  # slots[own_from:] are the request's own pages; before: the tree's
    lock: IncLockRefResult
    req_row: int
    state_slot: int = 0  # recurrent working slot (hybrid models)
    cached: int = 0  # prompt tokens the exact-prefix hit served
    reused: int = 0  # prompt tokens whose KV a donor gave at another offset
    # Prompt spans [start, end) whose KV was copied from donors (ascending): prefill skips them,
    # or (``selective``) runs through them as ``blend_spans``, recomputing the tokens whose KV
    # deviates most.
    reused_spans: list[tuple[int, int]] = field(default_factory=list)
    blend_spans: list[tuple[int, int]] = field(default_factory=list)
    selective: Any = None
    approximate_from: int | None = None  # first position whose KV is not exact (committed so)


class RequestCache:
    def __init__(
        self,
        tree: UnifiedRadixCache,
        kv: PageAllocator,
        req_to_token: ReqToTokenPool,
        recurrent: RecurrentPool | None,
        max_context: int,
        track_interval: int | None,
        windows: SWAWindows | None = None,
        reuse: Reuse | None = None,
    ) -> None:
        self.tree = tree
        self.kv = kv
        self.page_size: int = kv.page_size
        self.req_to_token = req_to_token
        self.recurrent = recurrent
        self.max_context = max_context
        self.track_interval = track_interval
        self.windows = windows  # sliding-window pages of running requests
        self.window = NoWindows() if windows is None else LeaseWindows(tree, windows)
        self.reuses = tree.reuses_prefixes
        # Without reuse nothing is committed while a request runs (the stand-in cache would
        # free the pages it is handed); a recurrent model commits at track boundaries only.
        self.commits_prefill = self.reuses and recurrent is None
        self.reuse = reuse

    # -- admission ------------------------------------------------------------------------------
    def admit(self, req: Holder) -> Lease | None:
        """A lease for ``req``, or None when the pools cannot hold it now."""
        if self.req_to_token.available() == 0:
            return None
        tree = self.tree
        key = req.prompt_ids[:-1] if req.reads_cache else []
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(key, req.extra_key)))
        cached = m.prefix_len
        own_tokens = len(req.prompt_ids) + req.max_new - cached
        # NOTE: lock the hit before evicting for room, so eviction cannot take the hit itself.
        lock = tree.inc_lock_ref(m.last_node)
        reuse, plan, lease = self.reuse, None, None
        try:
            # NOTE: a plan's donors stay locked until their runs are copied.
            plan = reuse.plan(req, cached) if reuse is not None and req.reads_cache else None
            pinned = self.window.pinned(lock)
            enough = self._room(req, own_tokens, pinned)
            if not enough and plan is not None:  # NOTE: the locked donors may leave no room
                reuse.drop(plan)  # type: ignore[union-attr]
                plan = None
                enough = self._room(req, own_tokens, pinned)
            if not enough:
                tree.dec_lock_ref(lock)
                return None
            own = self.kv.alloc(own_tokens)
            assert own is not None, "pages were ensured"
            slots = torch.cat([m.device_indices, own]) if cached else own
            row = self.req_to_token.alloc()
            assert row is not None
            lease = Lease(slots, own_from=cached, lock=lock, req_row=row, cached=cached)
            if plan is not None:
                reuse.realise(plan, lease)  # type: ignore[union-attr]
                plan = None
            self.window.reserve(req, cached, pinned)
            self.req_to_token.write(row, 0, slots[: self.max_context])
            if self.recurrent is not None:
                slot = self.recurrent.alloc(1, SlotRole.COW if m.recurrent_hit else SlotRole.ACTIVE)
                assert slot is not None, "slots were ensured"
                if m.recurrent_hit:
                    # NOTE: the source node is locked (above) while its snapshot is cloned.
                    src = torch.tensor([m.recurrent_slot], dtype=torch.int64)
                    self.recurrent.copy_slots(src, slot)
                    self.recurrent.set_role(slot, SlotRole.ACTIVE)
                lease.state_slot = int(slot[0])
            return lease
        except BaseException:  # NOTE: an admission that raises holds nothing afterwards
            if plan is not None:
                reuse.drop(plan)  # type: ignore[union-attr]
            if lease is None:
                tree.dec_lock_ref(lock)
            else:
                self.release(req, lease, 0, commit=False, idle=True)
            raise

    def cached_len(self, ids: list[int], extra_key: Hashable) -> int:
        """How many of ``ids`` an admission would find cached now; read-only."""
        return self.tree.peek_prefix_len(RadixKey(ids, extra_key))

    def _room(self, req: Holder, own_tokens: int, pinned: int) -> bool:
        """Room for ``req``'s own pages, state slot and window, evicting what is unlocked."""
        enough = self._ensure_pages(self.kv.pages_for(own_tokens))
        if enough and self.recurrent is not None:
            enough = self._ensure_slots(1)
        return enough and self.window.room(req, pinned)

    def _ensure_pages(self, pages: int) -> bool:
        short = pages - self.kv.num_free_pages()
        if short > 0 and self.tree.evictable_size() > 0:
            self.tree.evict(EvictParams(num_tokens=short * self.page_size))
        return self.kv.num_free_pages() >= pages

    def _ensure_slots(self, n: int) -> bool:
        assert self.recurrent is not None
        short = n - self.recurrent.available_size()
        if short > 0:
            self.tree.evict(EvictParams(recurrent_num=short))
        return self.recurrent.available_size() >= n

    # -- before a step --------------------------------------------------------------------------
    def advance_window(self, req: Holder, lease: Lease, start: int, end: int) -> None:
        """Before a step computes ``[start, end)``: sliding-window pages in and out."""
        self.window.advance(req, lease, start, end)

    def chunk_limit(self, start: int, length: int) -> int:
        """Split prefill at track boundaries so a boundary state is a chunk's final state."""
        ti = self.track_interval
        if self.recurrent is None or not ti:
            return length
        return min(length, (start // ti + 1) * ti - start)

    def take_track_slot(self, end: int) -> int:
        """A TRACK slot for a chunk ending at absolute position ``end``, or 0 (no publish)."""
        ti = self.track_interval
        if not self.reuses or self.recurrent is None or not ti or end % ti:
            return 0
        if not self._ensure_slots(1):
            return 0
        slot = self.recurrent.alloc(1, SlotRole.TRACK, zero=False)
        return int(slot[0]) if slot is not None else 0

    def drop_track_slot(self, slot: int) -> None:
        if slot and self.recurrent is not None:
            self.recurrent.release([slot])

    def drop_track_slot_if_held(self, slot: int) -> None:
        """After a commit that raised: the track slot goes back unless the tree took it."""
        if slot and self.recurrent is not None and self.recurrent.role_of(slot) is SlotRole.TRACK:
            self.recurrent.release([slot])

    # -- commit / release -----------------------------------------------------------------------
    def _insert(self, req: Holder, lease: Lease, n: int, snapshot: int | None) -> InsertResult:
        """Insert ``req``'s first ``n`` tokens with the tree's share of the window and the
        ``snapshot`` slot, and re-point the lease at the pages the tree already held."""
        key = RadixKey((req.prompt_ids + req.output_ids)[:n], req.extra_key)
        window, window_from = self.window.insert_value(req, n)
        approx = lease.approximate_from
        params = InsertParams(key, lease.slots[:n], snapshot, window, window_from, approx)
        r = self.tree.insert(params)
        # NOTE: an insert stops before approximate KV only where this lease holds none of it.
        assert r.aligned_len >= lease.own_from, (r.aligned_len, lease.own_from)
        if self.reuse is not None:
            self.reuse.note(req, key, r)
        if r.prefix_len > lease.own_from:
            # The tree freed our copies of positions it already held: read its pages instead.
            key = RadixKey((req.prompt_ids + req.output_ids)[: r.aligned_len], req.extra_key)
            m = self.tree.match_prefix(MatchPrefixParams(key, full_only=True, approximate=True))
            assert m.prefix_len == r.aligned_len, (m.prefix_len, r.aligned_len)
            lease.slots[: r.aligned_len] = m.device_indices
            self.req_to_token.write(lease.req_row, 0, lease.slots[: r.aligned_len])
        self.window.hand_over(req, lease, r)
        stored = r.recurrent_taken and r.recurrent_stored
        if snapshot is not None and stored and self.recurrent is not None:
            self.recurrent.set_role([snapshot], SlotRole.TREE)  # taken, not stored: freed
        return r

    def commit(self, req: Holder, lease: Lease, n: int, state_slot: int | None = None) -> None:
        """Insert the first ``n`` of its prompt and output ids while the request keeps running;
        move its lock to the new node. A track ``state_slot`` the tree does not take is released."""
        r = self._insert(req, lease, n, state_slot)
        if state_slot is not None and not r.recurrent_taken:
            self.drop_track_slot(state_slot)
        new_lock = self.tree.inc_lock_ref(r.last_node)
        self.tree.dec_lock_ref(lease.lock)
        lease.lock = new_lock
        lease.own_from = max(lease.own_from, r.aligned_len)
        self.window.moved(req, new_lock)

    def release(self, req: Holder, lease: Lease, computed: int, commit: bool, idle: bool) -> None:
        """Commit the ``computed`` positions (``commit``) and free what the lease holds.

        ``idle``: no step is in flight, so the working state covers exactly the computed
        tokens; a step in flight may have advanced it, and then it is never kept as a snapshot.
        """
        keep = lease.own_from  # slots[:keep] belong to the tree
        state = lease.state_slot if self.recurrent is not None else 0
        if commit and computed > 0:
            aligned = computed % self.page_size == 0
            snapshot = state if state and aligned and idle and self.reuses else None
            r = self._insert(req, lease, computed, snapshot)
            if snapshot is not None and r.recurrent_taken:
                state = 0  # handed to the tree (stored, or freed as a duplicate)
            keep = max(keep, r.aligned_len)
        self.tree.dec_lock_ref(lease.lock)
        own = lease.slots[keep:]
        if own.numel():
            self.kv.free(own)
        if state and self.recurrent is not None:
            self.recurrent.release([state])
        self.window.release(req)
        self.req_to_token.free(lease.req_row)

    def clear(self) -> bool:
        """Evict everything the tree holds (its removals empty the position-independent donor
        index too); False, changing nothing, while any of it is locked."""
        if self.tree.num_outstanding_locks():
            return False
        every = 1 << 62
        self.tree.evict(EvictParams(num_tokens=every, swa_num_tokens=every, recurrent_num=every))
        return self.tree.total_size("full") == 0  # no node left: no window or snapshot either

    # -- ledger ---------------------------------------------------------------------------------
    def check(self, leases: dict[str, Lease], track_held: int = 0) -> None:
        """Every pool's ledger against what the tree and the running ``leases`` hold."""
        held = sum(lease.slots.numel() - lease.own_from for lease in leases.values())
        self.kv.check_invariants()
        self.req_to_token.check_invariants()
        if self.reuse is not None:
            self.reuse.check()
        self.window.check(leases)
        active = sum(1 for lease in leases.values() if lease.state_slot)
        self.tree.check_invariants(
            request_held_tokens=held,
            pending_free_tokens=self.kv.pending_size(),
            request_held_slots=active + track_held,
            pending_free_slots=0 if self.recurrent is None else self.recurrent.pending_size(),
        )
        if self.recurrent is not None:
            self.recurrent.check_invariants(
                tree_held=self.tree.total_size("recurrent"),
                active_held=active,
                track_held=track_held,
            )
