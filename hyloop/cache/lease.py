"""The request side of the cache: what a running request holds, from admission to release.

A lease's KV row, by position (``Lease.slots``, mirrored in its req->token row)::

    [0, own_from)            the tree's pages: the prefix hit, and what later commits handed
                             over; read under ``lock``
    [own_from, len(slots))   the request's own pages, reserved at admission for its whole
                             prompt and its max new tokens

plus, on hybrid models, one working state slot, and on sliding-window models its window pages
(``pools.SWAWindows``, keyed by the request id). Every page and slot a request touches passes
through here, so the ledger (free + pending-free + request-held + tree-held == capacity) has
one place to be right. The scheduler calls down:

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

Frees follow the pools' ``StepFence``: what a launched step may still read waits for it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hyloop.cache.key import RadixKey
from hyloop.cache.params import (
    EvictParams,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
)
from hyloop.cache.protocol import PrefixCache
from hyloop.pools import PageAllocator, RecurrentPool, ReqToTokenPool, SlotRole, SWAWindows


class Holder(Protocol):
    """What the cache reads of a request (``framework.requests.Request``)."""

    request_id: str
    prompt_ids: list[int]
    max_new: int
    reads_cache: bool  # False: computes its whole prompt (it wants the prompt's logprobs)

    @property
    def extra_key(self) -> Hashable: ...  # its namespace in the tree (a prompt's cache_salt)

    @property
    def all_ids(self) -> list[int]: ...

    @property
    def total_len(self) -> int: ...


class Reuse(Protocol):
    """Position-independent reuse of a prompt's unmatched tail (``framework.reuse``);
    ``selective``: None when prefill skips reused spans, else the selective-recompute policy
    prefill applies while it runs through them."""

    selective: Any

    def plan(self, req: Any, cached: int) -> Any: ...

    def realise(self, plan: Any, slots: torch.Tensor) -> None: ...

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
        tree: PrefixCache,
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
        self.reuses = tree.reuses_prefixes
        self.windows_in_tree = windows is not None and self.reuses
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
        donors: list[IncLockRefResult] = []
        lease: Lease | None = None
        try:
            reuse = self.reuse is not None and req.reads_cache
            plan = self.reuse.plan(req, cached) if reuse else None  # type: ignore[union-attr]
            # NOTE: donors stay locked from the plan until their runs are copied.
            donors = [tree.inc_lock_ref(s.node) for s in plan.reused] if plan else []
            pinned = self._pinned_pages(lock)
            enough = self._room(req, own_tokens, pinned)
            if not enough and donors:  # NOTE: the locked donors may be what leaves no room
                for d in donors:
                    tree.dec_lock_ref(d.to_dec_params())
                plan, donors = None, []
                enough = self._room(req, own_tokens, pinned)
            if not enough:
                for d in [*donors, lock]:
                    tree.dec_lock_ref(d.to_dec_params())
                return None
            own = self.kv.alloc(own_tokens)
            assert own is not None, "pages were ensured"
            slots = torch.cat([m.device_indices.to(torch.int64), own]) if cached else own
            row = self.req_to_token.alloc()
            assert row is not None
            lease = Lease(slots, own_from=cached, lock=lock, req_row=row, cached=cached)
            if plan is not None and donors:
                assert self.reuse is not None
                self.reuse.realise(plan, slots)
                for d in donors:
                    tree.dec_lock_ref(d.to_dec_params())
                donors = []
                spans = [(s.start, s.end) for s in plan.reused]
                if self.reuse.selective is None:
                    lease.reused_spans = spans
                else:
                    lease.blend_spans, lease.selective = spans, self.reuse.selective
                lease.reused = plan.reused_tokens
                lease.approximate_from = spans[0][0]
            if self.windows is not None:
                self.windows.reserve(req.request_id, _positions(req), req.total_len, cached, pinned)
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
            for d in donors:
                tree.dec_lock_ref(d.to_dec_params())
            if lease is None:
                tree.dec_lock_ref(lock.to_dec_params())
            else:
                self.release(req, lease, 0, commit=False, idle=True)
            raise

    def _room(self, req: Holder, own_tokens: int, pinned: int) -> bool:
        """Room for ``req``'s own pages, state slot and window, evicting what is unlocked."""
        enough = self._ensure_pages(self.kv.pages_for(own_tokens))
        if enough and self.recurrent is not None:
            enough = self._ensure_slots(1)
        if enough and self.windows is not None:
            enough = self._ensure_window(req, pinned)
        return enough

    def _ensure_pages(self, pages: int) -> bool:
        short = pages - self.kv.num_free_pages()
        if short > 0 and self.tree.evictable_size() > 0:
            self.tree.evict(EvictParams(num_tokens=short * self.page_size))
        return self.kv.num_free_pages() >= pages

    def _ensure_window(self, req: Holder, pinned: int) -> bool:
        """Room in the sliding-window pool for ``req``'s reservation (counting the ``pinned``
        pages of its hit) next to the running ones'. What no reservation holds is free or the
        tree's unpinned windows; these are evicted now as far as the reservations ask, so a
        planned step rarely finds them still to evict (``window_room``)."""
        assert self.windows is not None
        positions, total = _positions(req), req.total_len
        if not self.windows.fits(positions, total):
            return False
        self._evict_window(self.windows.shortfall(positions, total, pinned))
        return True

    def _pinned_pages(self, lock: IncLockRefResult) -> int:
        """Window pages the tree pins under ``lock`` (counted against its request)."""
        if not self.windows_in_tree:
            return 0
        return self.tree.pinned_size(lock, "swa") // self.page_size

    def _evict_window(self, pages: int) -> None:
        if pages > 0 and self.windows_in_tree and self.tree.evictable_size("swa") > 0:
            self.tree.evict(EvictParams(swa_num_tokens=pages * self.page_size))

    def _ensure_slots(self, n: int) -> bool:
        assert self.recurrent is not None
        short = n - self.recurrent.available_size()
        if short > 0:
            self.tree.evict(EvictParams(recurrent_num=short))
        return self.recurrent.available_size() >= n

    # -- before a step --------------------------------------------------------------------------
    def advance_window(self, req: Holder, lease: Lease, start: int, end: int) -> None:
        """Before a step computes ``[start, end)``: sliding-window pages in and out, and the
        lock's window pages the step no longer reads released (the reservation counts them)."""
        if self.windows is not None:
            if self.windows_in_tree:
                first = max(0, start - self.windows.window + 1) // self.page_size
                lease.lock = self.tree.release_before(lease.lock, first * self.page_size)
                self.windows.set_pinned(req.request_id, self._pinned_pages(lease.lock))
            self._evict_window(self.windows.shortfall_for(req.request_id, start, end))
            self.windows.advance(req.request_id, lease.slots, start, end, req.total_len)

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
        key = RadixKey(req.all_ids[:n], req.extra_key)
        window, window_from = None, 0
        if self.windows_in_tree:
            assert self.windows is not None
            window, window_from = self.windows.insert_value(req.request_id, n)
        approx = lease.approximate_from
        params = InsertParams(key, lease.slots[:n], snapshot, window, window_from, approx)
        r = self.tree.insert(params)
        # NOTE: an insert stops before approximate KV only where this lease holds none of it.
        assert r.aligned_len >= lease.own_from, (r.aligned_len, lease.own_from)
        if self.reuse is not None:
            self.reuse.note(req, key, r)
        if r.prefix_len > lease.own_from:
            # The tree freed our copies of positions it already held: read its pages instead.
            key = RadixKey(req.all_ids[: r.aligned_len], req.extra_key)
            m = self.tree.match_prefix(MatchPrefixParams(key, full_only=True, approximate=True))
            assert m.prefix_len == r.aligned_len, (m.prefix_len, r.aligned_len)
            lease.slots[: r.aligned_len] = m.device_indices
            self.req_to_token.write(lease.req_row, 0, lease.slots[: r.aligned_len])
        if self.windows_in_tree:
            assert self.windows is not None
            self.windows.hand_over(req.request_id, lease.slots, r.aligned_len, r.swa_taken)
        stored = r.recurrent_taken and r.recurrent_stored
        if snapshot is not None and stored and self.recurrent is not None:
            self.recurrent.set_role([snapshot], SlotRole.TREE)  # taken, not stored: freed
        return r

    def commit(self, req: Holder, lease: Lease, n: int, state_slot: int | None = None) -> None:
        """Insert ``all_ids[:n]`` while the request keeps running; move its lock to the new node.
        A track ``state_slot`` the tree does not take is released."""
        r = self._insert(req, lease, n, state_slot)
        if state_slot is not None and not r.recurrent_taken:
            self.drop_track_slot(state_slot)
        new_lock = self.tree.inc_lock_ref(r.last_node)
        self.tree.dec_lock_ref(lease.lock.to_dec_params())
        lease.lock = new_lock
        lease.own_from = max(lease.own_from, r.aligned_len)
        if self.windows_in_tree:
            assert self.windows is not None
            self.windows.set_pinned(req.request_id, self._pinned_pages(new_lock))

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
        self.tree.dec_lock_ref(lease.lock.to_dec_params())
        own = lease.slots[keep:]
        if own.numel():
            self.kv.free(own)
        if state and self.recurrent is not None:
            self.recurrent.release([state])
        if self.windows is not None:
            self.windows.release(req.request_id)
        self.req_to_token.free(lease.req_row)

    def clear(self) -> bool:
        """Evict everything the tree holds (its removals empty the position-independent donor
        index too); False, changing nothing, while any of it is locked."""
        tree = self.tree
        if tree.num_outstanding_locks():
            return False
        every = 1 << 62
        tree.evict(EvictParams(num_tokens=every, swa_num_tokens=every, recurrent_num=every))
        return tree.total_size("full") == 0  # no node left: no window or snapshot either

    # -- ledger ---------------------------------------------------------------------------------
    def check(self, leases: dict[str, Lease], track_held: int = 0) -> None:
        """Every pool's ledger against what the tree and the running ``leases`` hold."""
        held = sum(lease.slots.numel() - lease.own_from for lease in leases.values())
        self.kv.check_invariants()
        self.req_to_token.check_invariants()
        pending = self.kv.pending_size()
        if self.reuse is not None:
            self.reuse.check()
        if self.windows is not None:
            tree_window = self.tree.total_size("swa") if self.windows_in_tree else 0
            pinned = {rid: self._pinned_pages(lease.lock) for rid, lease in leases.items()}
            self.windows.check(set(leases), tree_window, pinned)
        if self.recurrent is None:
            self.tree.check_invariants(request_held_tokens=held, pending_free_tokens=pending)
            return
        active = sum(1 for lease in leases.values() if lease.state_slot)
        self.tree.check_invariants(
            request_held_tokens=held,
            pending_free_tokens=pending,
            request_held_slots=active + track_held,
            pending_free_slots=self.recurrent.pending_size(),
        )
        self.recurrent.check_invariants(
            tree_held=self.tree.total_size("recurrent"),
            active_held=active,
            track_held=track_held,
        )


def _positions(req: Holder) -> int:
    return len(req.prompt_ids) + req.max_new
