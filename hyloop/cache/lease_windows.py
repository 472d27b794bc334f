"""The sliding-window side of a lease: a running request's window pages (``pools.SWAWindows``)
kept in step with the tree's window data and with the window its lock pins.

A lease's lock pins the tree's window pages its request reads (counted against the request's
reservation, ``pinned``); before each step the lock lets go of the pages the step no longer
reads, and the pool's pages move in and out. NOTE: the no-reuse cache pins, holds and takes
no window pages, so these calls are the same with either cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hyloop.cache.params import EvictParams, IncLockRefResult, InsertResult
from hyloop.pools import SWAWindows

if TYPE_CHECKING:
    from hyloop.cache.lease import Holder, Lease
    from hyloop.cache.unified import UnifiedRadixCache


class NoWindows:
    """A model without sliding-window layers: its leases hold no window pages."""

    def pinned(self, lock: IncLockRefResult) -> int:
        return 0

    def room(self, req: Holder, pinned: int) -> bool:
        return True

    def reserve(self, req: Holder, cached: int, pinned: int) -> None:
        pass

    def advance(self, req: Holder, lease: Lease, start: int, end: int) -> None:
        pass

    def insert_value(self, req: Holder, n: int) -> tuple[torch.Tensor | None, int]:
        return None, 0

    def hand_over(self, req: Holder, lease: Lease, r: InsertResult) -> None:
        pass

    def moved(self, req: Holder, lock: IncLockRefResult) -> None:
        pass

    def release(self, req: Holder) -> None:
        pass

    def check(self, leases: dict[str, Lease]) -> None:
        pass


class LeaseWindows(NoWindows):
    """Window pages of the running requests in ``pages``, beside ``tree``'s."""

    def __init__(self, tree: UnifiedRadixCache, pages: SWAWindows) -> None:
        self.tree = tree
        self.pages = pages
        self.page_size = pages.page_size

    def pinned(self, lock: IncLockRefResult) -> int:
        """Window pages the tree pins under ``lock`` (counted against its request)."""
        return self.tree.pinned_size(lock, "swa") // self.page_size

    def _evict(self, pages: int) -> None:
        if pages > 0 and self.tree.evictable_size("swa") > 0:
            self.tree.evict(EvictParams(swa_num_tokens=pages * self.page_size))

    def room(self, req: Holder, pinned: int) -> bool:
        """Room in the window pool for ``req``'s reservation (counting the ``pinned`` pages of
        its hit) next to the running ones'. What no reservation holds is free or the tree's
        unpinned windows; these are evicted now as far as the reservations ask, so a planned
        step rarely finds them still to evict (``SWAWindows.room``)."""
        positions, total = _positions(req), req.total_len
        if not self.pages.fits(positions, total):
            return False
        self._evict(self.pages.shortfall(positions, total, pinned))
        return True

    def reserve(self, req: Holder, cached: int, pinned: int) -> None:
        self.pages.reserve(req.request_id, _positions(req), req.total_len, cached, pinned)

    def advance(self, req: Holder, lease: Lease, start: int, end: int) -> None:
        """Before a step computes ``[start, end)``: the lock's window pages the step no longer
        reads released (the reservation counts them), and window pages in and out."""
        first = max(0, start - self.pages.window + 1) // self.page_size
        lease.lock = self.tree.release_before(lease.lock, first * self.page_size)
        self.moved(req, lease.lock)
        self._evict(self.pages.shortfall_for(req.request_id, start, end))
        self.pages.advance(req.request_id, lease.slots, start, end, req.total_len)

    def insert_value(self, req: Holder, n: int) -> tuple[torch.Tensor | None, int]:
        """``(swa_value, swa_from)`` of an insert of ``req``'s first ``n`` tokens."""
        return self.pages.insert_value(req.request_id, n)

    def hand_over(self, req: Holder, lease: Lease, r: InsertResult) -> None:
        self.pages.hand_over(req.request_id, lease.slots, r.aligned_len, r.swa_taken)

    def moved(self, req: Holder, lock: IncLockRefResult) -> None:
        """``req``'s lock moved or slid on: charge it what it pins now."""
        self.pages.set_pinned(req.request_id, self.pinned(lock))

    def release(self, req: Holder) -> None:
        self.pages.release(req.request_id)

    def check(self, leases: dict[str, Lease]) -> None:
        pinned = {rid: self.pinned(lease.lock) for rid, lease in leases.items()}
        self.pages.check(set(leases), self.tree.total_size("swa"), pinned)


def _positions(req: Holder) -> int:
    return len(req.prompt_ids) + req.max_new
