"""Sliding-window pages of running requests: allocated as positions are computed, freed as they
fall out of the window.

A step computing positions ``[start, end)`` of a request reads, on sliding layers, keys at
positions ``> start - window``; every page wholly before that is released before the step is
launched (through the pool's ``StepFence``, so a step still in flight keeps reading it). A
request therefore holds at most ``window + page_size`` tokens during decode and
``window + prefill_chunk`` (plus page rounding) during chunked prefill.

Admission reserves a request's worst case (``pages_per_request``), so a step never fails to
allocate.
"""

from __future__ import annotations

from collections import deque

import torch

from hyloop.framework.request import Request
from hyloop.pools import SWAKVPool


class SWAWindows:
    def __init__(self, pool: SWAKVPool, window: int, prefill_chunk: int) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.window = window
        self.pages_per_request = self.worst_case_pages(window, prefill_chunk, pool.page_size)
        self.reserved = 0  # pages reserved by admitted requests
        # request id -> (reserved pages, deque of (page index within the request, pool slots))
        self._held: dict[str, tuple[int, deque[tuple[int, torch.Tensor]]]] = {}

    @staticmethod
    def worst_case_pages(window: int, prefill_chunk: int, page_size: int) -> int:
        """Most pages one request holds: positions ``(start - window, start + chunk)``, whose
        two ends may each sit in a partial page."""
        return -(-(window + prefill_chunk) // page_size) + 2

    def request_pages(self, req: Request) -> int:
        positions = len(req.prompt_ids) + req.max_new
        return min(self.pages_per_request, -(-positions // self.page_size))

    def can_reserve(self, req: Request) -> bool:
        return self.reserved + self.request_pages(req) <= self.allocator.num_pages - 1

    def reserve(self, req: Request) -> None:
        need = self.request_pages(req)
        self.reserved += need
        self._held[req.request_id] = (need, deque())

    def advance(self, req: Request, start: int, end: int) -> None:
        """Before a step computes positions ``[start, end)`` of ``req``: free the pages out of
        its window, allocate and map the pages of the new positions."""
        assert req.slots is not None
        _, pages = self._held[req.request_id]
        ps = self.page_size
        first_needed = max(0, start - self.window + 1) // ps
        dropped = []
        while pages and pages[0][0] < first_needed:
            dropped.append(pages.popleft()[1])
        if dropped:
            self.allocator.free(torch.cat(dropped))
        next_page = pages[-1][0] + 1 if pages else first_needed
        last_page = (end - 1) // ps
        if last_page < next_page:
            return
        n = last_page - next_page + 1
        slots = self.allocator.alloc(n * ps)
        assert slots is not None, "sliding-window pages were reserved at admission"
        full = req.slots[next_page * ps : (last_page + 1) * ps]
        self.pool.map(full, slots[: full.numel()])
        for i in range(n):
            pages.append((next_page + i, slots[i * ps : (i + 1) * ps]))

    def release(self, req: Request) -> None:
        entry = self._held.pop(req.request_id, None)
        if entry is None:
            return
        need, pages = entry
        self.reserved -= need
        if pages:
            self.allocator.free(torch.cat([slots for _, slots in pages]))

    def held_tokens(self, req: Request) -> int:
        entry = self._held.get(req.request_id)
        return 0 if entry is None else len(entry[1]) * self.page_size

    def used_tokens(self) -> int:
        return sum(len(pages) for _, pages in self._held.values()) * self.page_size

    def check(self, running: list[Request]) -> None:
        """Ledger: request-held + free + pending-free == capacity; held within reservations."""
        self.allocator.check_invariants()
        alloc = self.allocator
        held = sum(len(pages) for _, pages in self._held.values())
        total = held + alloc.num_free_pages() + alloc.pending_size() // self.page_size
        if total != alloc.num_pages - 1:
            raise AssertionError(
                f"sliding-window pool: held {held} + free {alloc.num_free_pages()} + pending "
                f"{alloc.pending_size() // self.page_size} != {alloc.num_pages - 1} pages"
            )
        live = {r.request_id for r in running}
        if set(self._held) - live:
            raise AssertionError(f"sliding-window pool: pages held by {set(self._held) - live}")
        for need, pages in self._held.values():
            if len(pages) > need:
                raise AssertionError(f"sliding-window pool: {len(pages)} pages > reserved {need}")
        if self.reserved != sum(need for need, _ in self._held.values()):
            raise AssertionError("sliding-window pool: reservations disagree")
