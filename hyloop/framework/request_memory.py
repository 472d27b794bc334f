"""Per-request pool and cache bookkeeping: admit, commit prefixes, publish tracks, release.

Every page and state slot a request touches passes through here, so the ledger
(free + pending-free + request-held + tree-held == capacity) has one place to be right.

Lifecycle of a request:
1. ``admit``: match the prompt in the UHRC, lock the hit, reserve KV pages for the rest of the
   request (evicting unlocked tree entries if short), take a working state slot and, on a
   recurrent hit, copy-on-write the node's snapshot into it while the node is locked. With
   position-independent reuse, the unmatched tail is planned too: each reused run's donor is
   locked before anything is evicted and its KV moved into the request's pages before release.
2. ``commit``: as prefill chunks complete (and at track boundaries for hybrid models), insert the
   computed prefix; the tree takes its page-aligned part, the request re-points any duplicate
   positions to the tree's pages and moves its lock to the new node.
3. ``release``: on finish, commit the whole computed sequence (with the end state snapshot when
   it is page aligned), unlock and free what the tree did not take; on abort, free only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from hyloop.cache import (
    EvictParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    PrefixCache,
    RadixKey,
)
from hyloop.framework.request import Request
from hyloop.framework.swa_windows import SWAWindows
from hyloop.pools import PageAllocator, RecurrentPool, ReqToTokenPool, SlotRole

if TYPE_CHECKING:
    from hyloop.framework.position_independent import PositionIndependentReuse

# A request is held back one step when an admitted, still-prefilling request shares at least this
# many more prompt tokens with it than the cache can serve: it will hit them after the insert.
DEFER_MIN_SHARED = 16


class RequestMemory:
    def __init__(
        self,
        cache: PrefixCache,
        kv_allocator: PageAllocator,
        req_to_token: ReqToTokenPool,
        recurrent: RecurrentPool | None,
        max_context: int,
        track_interval: int | None,
        pi_reuse: PositionIndependentReuse | None = None,
        swa: SWAWindows | None = None,
    ) -> None:
        self.cache = cache
        self.swa = swa  # sliding-window pages of running requests (models with such layers)
        self.swa_in_tree = swa is not None and cache.reuses_prefixes
        self.kv = kv_allocator
        self.page_size: int = kv_allocator.page_size
        self.req_to_token = req_to_token
        self.recurrent = recurrent
        self.max_context = max_context
        self.track_interval = track_interval
        # Without reuse nothing is committed while a request runs (the stand-in cache would
        # free the pages it is handed); finished requests still go through insert.
        self.reuse = cache.reuses_prefixes
        self.commit_during_prefill = self.reuse and recurrent is None
        self.pi = pi_reuse  # position-independent reuse of the unmatched tail, when enabled

    # -- admission ------------------------------------------------------------------------------
    def admit(self, req: Request, inflight: list[Request]) -> bool | None:
        if self.req_to_token.available() == 0:
            return False
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.prompt_ids[:-1])))
        cached = m.prefix_len
        for other in inflight:
            if other.prefill_done:
                continue
            shared = len(os.path.commonprefix([req.prompt_ids[:-1], other.prompt_ids]))
            if shared - cached >= max(DEFER_MIN_SHARED, self.page_size):
                return None
        own_tokens = len(req.prompt_ids) + req.max_new - cached
        # NOTE: lock the hit before evicting for room, so eviction cannot take the hit itself.
        lock = self.cache.inc_lock_ref(m.last_node)
        plan = self.pi.plan(req, cached) if self.pi is not None else None
        # NOTE: donors stay locked from the plan until their runs are copied.
        donors = [self.cache.inc_lock_ref(s.node) for s in plan.reused] if plan else []
        enough = self._ensure_pages(self.kv.pages_for(own_tokens))
        if enough and self.recurrent is not None:
            enough = self._ensure_slots(1)
        if enough and self.swa is not None:
            enough = self._ensure_swa(req)
        if not enough:
            for d in [*donors, lock]:
                self.cache.dec_lock_ref(d.to_dec_params())
            return False
        own = self.kv.alloc(own_tokens)
        assert own is not None, "pages were ensured"
        req.slots = torch.cat([m.device_indices.to(torch.int64), own]) if cached else own
        if plan is not None and donors:
            assert self.pi is not None
            self.pi.realise(plan, req.slots)
            for d in donors:
                self.cache.dec_lock_ref(d.to_dec_params())
            req.reused_spans = [(s.start, s.end) for s in plan.reused]
            req.num_reused = plan.reused_tokens
        req.own_from = cached
        req.lock = lock
        req.num_cached = cached
        req.num_computed = cached
        if self.swa is not None:
            self.swa.reserve(req, cached)
        row = self.req_to_token.alloc()
        assert row is not None
        req.req_row = row
        self.req_to_token.write(row, 0, req.slots[: self.max_context])
        if self.recurrent is not None:
            slot = self.recurrent.alloc(1, SlotRole.COW if m.recurrent_hit else SlotRole.ACTIVE)
            assert slot is not None, "slots were ensured"
            if m.recurrent_hit:
                # NOTE: the source node is locked (above) while its snapshot is cloned.
                src = torch.tensor([m.recurrent_slot], dtype=torch.int64)
                self.recurrent.copy_slots(src, slot)
                self.recurrent.set_role(slot, SlotRole.ACTIVE)
            req.state_slot = int(slot[0])
        return True

    def _ensure_pages(self, pages: int) -> bool:
        short = pages - self.kv.num_free_pages()
        if short > 0 and self.cache.evictable_size() > 0:
            self.cache.evict(EvictParams(num_tokens=short * self.page_size))
        return self.kv.num_free_pages() >= pages

    def _ensure_swa(self, req: Request) -> bool:
        """Room in the sliding-window pool for ``req``'s window next to the running ones',
        evicting the tree's unlocked windows when short."""
        assert self.swa is not None
        if not self.swa.fits(req):
            return False
        self._evict_swa(self.swa.shortfall(req))
        return self.swa.shortfall(req) <= 0

    def _evict_swa(self, pages: int) -> None:
        if pages > 0 and self.swa_in_tree and self.cache.evictable_size("swa") > 0:
            self.cache.evict(EvictParams(swa_num_tokens=pages * self.page_size))

    def _ensure_slots(self, n: int) -> bool:
        assert self.recurrent is not None
        short = n - self.recurrent.available_size()
        if short > 0:
            self.cache.evict(EvictParams(recurrent_num=short))
        return self.recurrent.available_size() >= n

    def advance_window(self, req: Request, start: int, end: int) -> None:
        """Before a step computes ``[start, end)``: sliding-window pages in and out."""
        if self.swa is not None and req.slots is not None:
            self._evict_swa(self.swa.shortfall_for(req, start, end))
            self.swa.advance(req, start, end)

    # -- tracks (hybrid models) -----------------------------------------------------------------
    def chunk_limit(self, req: Request, start: int, length: int) -> int:
        """Split prefill at track boundaries so a boundary state is a chunk's final state."""
        ti = self.track_interval
        if self.recurrent is None or not ti:
            return length
        boundary = (start // ti + 1) * ti
        return min(length, boundary - start)

    def take_track_slot(self, end: int) -> int:
        """A TRACK slot for a chunk ending at absolute position ``end``, or 0 (no publish)."""
        ti = self.track_interval
        if not self.reuse or self.recurrent is None or not ti or end % ti:
            return 0
        if not self._ensure_slots(1):
            return 0
        slot = self.recurrent.alloc(1, SlotRole.TRACK, zero=False)
        return int(slot[0]) if slot is not None else 0

    def drop_track_slot(self, slot: int) -> None:
        if slot and self.recurrent is not None:
            self.recurrent.release([slot])

    # -- commit / release -----------------------------------------------------------------------
    def commit(self, req: Request, n: int, state_slot: int | None = None) -> None:
        """Insert ``all_ids[:n]`` while the request keeps running; move its lock to the new node."""
        assert req.slots is not None
        key = RadixKey(req.all_ids[:n])
        swa_value, swa_from = self._swa_insert_value(req, n)
        r = self.cache.insert(
            InsertParams(
                key=key,
                value=req.slots[:n],
                recurrent_slot=state_slot,
                swa_value=swa_value,
                swa_from=swa_from,
            )
        )
        self._settle_state_slot(state_slot, r)
        if self.pi is not None:
            self.pi.note(req, key, r)
        if r.prefix_len > req.own_from:
            # The tree freed our copies of positions it already held: read its pages instead.
            m = self.cache.match_prefix(
                MatchPrefixParams(key=RadixKey(req.all_ids[: r.aligned_len]), full_only=True)
            )
            assert m.prefix_len == r.aligned_len, (m.prefix_len, r.aligned_len)
            req.slots[: r.aligned_len] = m.device_indices
            self.req_to_token.write(req.req_row, 0, req.slots[: r.aligned_len])
        if self.swa_in_tree:
            assert self.swa is not None
            self.swa.hand_over(req, r.aligned_len, r.swa_taken)
        new_lock = self.cache.inc_lock_ref(r.last_node)
        self.cache.dec_lock_ref(req.lock.to_dec_params())
        req.lock = new_lock
        req.own_from = max(req.own_from, r.aligned_len)

    def release(self, req: Request, commit: bool, state_current: bool = True) -> None:
        """Commit (optionally) and free what the request holds.

        Frees follow the pools' ``StepFence``: what a launched step may still read waits for it.
        ``state_current``: the working state covers exactly the committed tokens; a step in
        flight may have advanced it, and then it is never committed as a snapshot.
        """
        assert req.slots is not None
        keep = req.own_from  # slots[:keep] belong to the tree
        state = req.state_slot if self.recurrent is not None else 0
        if commit and req.num_computed > 0:
            n = req.num_computed
            aligned = n % self.page_size == 0
            snapshot = state if state and aligned and state_current and self.reuse else None
            key = RadixKey(req.all_ids[:n])
            swa_value, swa_from = self._swa_insert_value(req, n)
            r = self.cache.insert(
                InsertParams(
                    key=key,
                    value=req.slots[:n],
                    recurrent_slot=snapshot,
                    swa_value=swa_value,
                    swa_from=swa_from,
                )
            )
            if self.pi is not None:
                self.pi.note(req, key, r)
            if self.swa_in_tree:
                assert self.swa is not None
                self.swa.hand_over(req, r.aligned_len, r.swa_taken)
            if snapshot is not None and r.recurrent_taken:
                state = 0  # handed to the tree (stored, or freed as a duplicate)
            if snapshot is not None:
                self._settle_state_slot(snapshot, r, release_if_kept=False)
            keep = max(keep, r.aligned_len)
        self.cache.dec_lock_ref(req.lock.to_dec_params())
        req.lock = None
        own = req.slots[keep:]
        if own.numel():
            self.kv.free(own)
        if state and self.recurrent is not None:
            self.recurrent.release([state])
        if self.swa is not None:
            self.swa.release(req)
        req.state_slot = 0
        self.req_to_token.free(req.req_row)
        req.req_row = -1
        req.slots = None

    def _swa_insert_value(self, req: Request, n: int) -> tuple[torch.Tensor | None, int]:
        if not self.swa_in_tree:
            return None, 0
        assert self.swa is not None
        return self.swa.insert_value(req, n)

    def _settle_state_slot(
        self, slot: int | None, r: InsertResult, release_if_kept: bool = True
    ) -> None:
        if slot is None or self.recurrent is None:
            return
        if r.recurrent_taken and r.recurrent_stored:
            self.recurrent.set_role([slot], SlotRole.TREE)
        elif not r.recurrent_taken and release_if_kept:
            self.recurrent.release([slot])
        # taken but not stored: the tree freed it (the allocator told the pool).

    # -- ledger ---------------------------------------------------------------------------------
    def check(self, running: list[Request], track_held: int = 0) -> None:
        held = sum(r.slots.numel() - r.own_from for r in running if r.slots is not None)
        self.kv.check_invariants()
        self.req_to_token.check_invariants()
        pending = self.kv.pending_size()
        if self.pi is not None:
            self.pi.check()
        if self.swa is not None:
            tree_swa = self.cache.total_size("swa") if self.swa_in_tree else 0
            self.swa.check(running, tree_swa)
        if self.recurrent is None:
            self.cache.check_invariants(request_held_tokens=held, pending_free_tokens=pending)
            return
        active = sum(1 for r in running if r.state_slot)
        self.cache.check_invariants(
            request_held_tokens=held,
            pending_free_tokens=pending,
            request_held_slots=active + track_held,
            pending_free_slots=self.recurrent.pending_size(),
        )
        self.recurrent.check_invariants(
            tree_held=self.cache.total_size("recurrent"),
            active_held=active,
            track_held=track_held,
        )
