"""Sliding-window pages of running requests: allocated as positions are computed, freed as they
fall out of the window, or handed to the radix tree on insert.

A step computing positions ``[start, end)`` of a request reads, on sliding layers, keys at
positions ``> start - window``; every page wholly before that is released before the step is
launched (through the pool's ``StepFence``, so a step still in flight keeps reading it). A
request therefore holds at most ``window + page_size`` tokens during decode and
``window + prefill_chunk`` (plus page rounding) during chunked prefill. Positions before
``tree_from`` are the tree's (a prefix hit, or pages an insert took); the request reads them
under its lock.

Admission reserves a request's worst case and keeps that many pages free for the admitted
requests, so a step never fails to allocate. The worst case while prefilling spans the window
plus one prefill chunk (no longer than what the request has to compute); once the request decodes
it spans the window plus one position, and its reservation shrinks to that, so a long prompt's
chunk does not cost the pool for the request's whole life.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from hyloop.framework.request import Request
from hyloop.pools import SWAKVPool


@dataclass
class _Window:
    reserved: int  # pages reserved at admission
    tree_from: int  # page index: pages before it are the tree's
    pages: deque[tuple[int, torch.Tensor]] = field(default_factory=deque)  # (page, pool slots)


class SWAWindows:
    def __init__(self, pool: SWAKVPool, window: int, prefill_chunk: int) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.window = window
        self.prefill_chunk = prefill_chunk
        self.pages_per_request = self.worst_case_pages(window, prefill_chunk, pool.page_size)
        self._held: dict[str, _Window] = {}

    @staticmethod
    def worst_case_pages(window: int, prefill_chunk: int, page_size: int) -> int:
        """Most pages one request holds: positions ``(start - window, start + chunk)``, whose
        two ends may each sit in a partial page, plus one freed page a launched step may still
        read while its successor allocates."""
        return -(-(window + prefill_chunk) // page_size) + 3

    def request_pages(self, req: Request, decoding: bool = False) -> int:
        """Most pages ``req`` can hold from now on: while prefilling, its window plus a chunk no
        longer than the tokens it has left to compute; while decoding, its window plus one."""
        chunk = 1 if decoding else min(self.prefill_chunk, max(1, req.total_len))
        positions = len(req.prompt_ids) + req.max_new
        worst = self.worst_case_pages(self.window, chunk, self.page_size)
        return min(worst, -(-positions // self.page_size) + 1)

    def shortfall(self, req: Request) -> int:
        """Pages to free (evict from the tree) before ``req`` can be admitted; <= 0: none."""
        owed = sum(w.reserved - len(w.pages) for w in self._held.values())
        return owed + self.request_pages(req) - self.allocator.num_free_pages()

    def fits(self, req: Request) -> bool:
        """Whether the pool could ever hold ``req``'s window next to the others'."""
        reserved = sum(w.reserved for w in self._held.values())
        return reserved + self.request_pages(req) <= self.allocator.num_pages - 1

    def shortfall_for(self, req: Request, start: int, end: int) -> int:
        """Pages ``advance(req, start, end)`` would allocate beyond the free ones."""
        w = self._held[req.request_id]
        ps = self.page_size
        first = (
            w.pages[-1][0] + 1
            if w.pages
            else max(max(0, start - self.window + 1) // ps, w.tree_from)
        )
        return (end - 1) // ps - first + 1 - self.allocator.num_free_pages()

    def reserve(self, req: Request, cached: int) -> None:
        self._held[req.request_id] = _Window(self.request_pages(req), cached // self.page_size)

    def advance(self, req: Request, start: int, end: int) -> None:
        """Before a step computes positions ``[start, end)`` of ``req``: free the pages out of
        its window, allocate and map the pages of the new positions."""
        assert req.slots is not None
        w = self._held[req.request_id]
        ps, pages = self.page_size, w.pages
        first_needed = max(0, start - self.window + 1) // ps
        dropped = []
        while pages and pages[0][0] < first_needed:
            dropped.append(pages.popleft()[1])
        if dropped:
            self.allocator.free(torch.cat(dropped))
        if end - start == 1 and start >= req.total_len - 1:
            # Decoding (a single position at the end; under lookahead ``total_len`` lags by
            # one): the chunk reserved for prefill is not needed again in this admission.
            w.reserved = min(w.reserved, max(len(pages), self.request_pages(req, decoding=True)))
        next_page = pages[-1][0] + 1 if pages else max(first_needed, w.tree_from)
        last_page = (end - 1) // ps
        if last_page < next_page:
            return
        n = last_page - next_page + 1
        slots = self.allocator.alloc(n * ps)
        if slots is None:
            raise RuntimeError(
                f"request {req.request_id!r}: the sliding-window pool has no free page although "
                "admission reserved them (pool ledger broken)"
            )
        full = req.slots[next_page * ps : (last_page + 1) * ps]
        self.pool.map(full, slots[: full.numel()])
        for i in range(n):
            pages.append((next_page + i, slots[i * ps : (i + 1) * ps]))

    def insert_value(self, req: Request, n: int) -> tuple[torch.Tensor | None, int]:
        """``(swa_value, swa_from)`` for inserting ``req``'s first ``n`` tokens: its window-pool
        slot per token, valid from its first held page on."""
        w = self._held.get(req.request_id)
        if w is None or not w.pages:
            return None, n
        ps = self.page_size
        value = torch.zeros(n, dtype=torch.int64)
        for page, slots in w.pages:
            a = page * ps
            if a >= n:
                break
            value[a : min(a + ps, n)] = slots[: min(ps, n - a)]
        return value, w.pages[0][0] * ps

    def hand_over(self, req: Request, aligned: int, taken: tuple[tuple[int, int], ...]) -> None:
        """After an insert of ``req``'s first ``aligned`` tokens: pages in ``taken`` are the
        tree's now (mapped from the full slots the request reads, which may be the tree's), the
        rest of those before ``aligned`` are duplicates or out of the window: freed."""
        w = self._held.get(req.request_id)
        if w is None:
            return
        assert req.slots is not None
        ps, pages = self.page_size, w.pages
        freed = []
        while pages and (pages[0][0] + 1) * ps <= aligned:
            page, slots = pages.popleft()
            a = page * ps
            if any(lo <= a and a + ps <= hi for lo, hi in taken):
                self.pool.map(req.slots[a : a + ps], slots)
            else:
                freed.append(slots)
        if freed:
            self.allocator.free(torch.cat(freed))
        w.tree_from = max(w.tree_from, aligned // ps)

    def release(self, req: Request) -> None:
        w = self._held.pop(req.request_id, None)
        if w is not None and w.pages:
            self.allocator.free(torch.cat([slots for _, slots in w.pages]))

    def held_tokens(self, req: Request) -> int:
        w = self._held.get(req.request_id)
        return 0 if w is None else len(w.pages) * self.page_size

    def used_tokens(self) -> int:
        """Pool tokens in use: held by requests, by the tree, or freed but still readable."""
        return self.allocator.capacity - self.allocator.available_size()

    def check(self, running: list[Request], tree_held_tokens: int) -> None:
        """Ledger: request-held + tree-held + free + pending-free == capacity."""
        alloc = self.allocator
        alloc.check_invariants()
        held = sum(len(w.pages) for w in self._held.values()) * self.page_size
        total = held + tree_held_tokens + alloc.available_size() + alloc.pending_size()
        if total != alloc.capacity:
            raise AssertionError(
                f"sliding-window pool: request-held {held} + tree {tree_held_tokens} + free "
                f"{alloc.available_size()} + pending {alloc.pending_size()} != {alloc.capacity}"
            )
        live = {r.request_id for r in running}
        if set(self._held) - live:
            raise AssertionError(f"sliding-window pool: pages held by {set(self._held) - live}")
        for rid, w in self._held.items():
            if len(w.pages) > w.reserved:
                raise AssertionError(
                    f"sliding-window pool: request {rid!r} holds {len(w.pages)} pages, "
                    f"reserved {w.reserved}"
                )
