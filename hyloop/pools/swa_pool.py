"""The sliding-window KV pool and the window pages of the requests running in it.

``SWAKVPool`` holds the K/V of sliding-window layers, for the window of each request only.

A token's identity stays its slot in the full pool (the req->token table, ``out_cache_loc`` and
the radix tree hold full-pool slots); ``full_to_swa`` translates a full slot into the slot that
holds the same token on the sliding layers (sglang's full->swa index mapping). The translation
is a device tensor the captured step gathers through, so which pages are live never changes a
shape.

NOTE: freed pages keep their stale entries in ``full_to_swa``: a launched step may still read
them, and every later reader masks those positions out (they lie outside its window) or sees
them re-pointed when the full slot is reused and its token computed again.

``SWAWindows`` keeps the window pages of running requests: allocated as positions are computed,
freed as they fall out of the window, or handed to the radix tree on insert.

A step computing positions ``[start, end)`` of a request reads, on sliding layers, keys at
positions ``> start - window``; every page wholly before that is released before the step is
launched (through the pool's ``StepFence``, so a step still in flight keeps reading it). A
request therefore holds at most ``window + page_size`` tokens during decode and
``window + prefill_chunk`` (plus page rounding) during chunked prefill. Positions before
``tree_from`` are the tree's (a prefix hit, or pages an insert took); the request reads them
under its lock.

One ledger: a request's reservation covers its worst case, counting the pages it holds and
the tree's window pages its lock pins (``pinned``: what it reads of a prefix hit or of what its
commits handed over; the lock pins only the window it reads, ``cache.component_swa``). The
reservations of the admitted requests fit the pool together, and what they do not hold is free
or the tree's unpinned windows, which the tree evicts on demand, so a step never fails to
allocate. The worst case while prefilling spans the window plus one prefill chunk (no longer
than what the request has to compute); once the request decodes it spans the window plus one
position (plus what its lock still pins behind), and its reservation shrinks to that, so a long
prompt's chunk does not cost the pool for the request's whole life.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from hyloop.pools.kv_pool import KVPool
from hyloop.pools.ledger import LedgerError
from hyloop.pools.step_fence import StepFence


class SWAKVPool(KVPool):
    """A ``KVPool`` for the sliding-window layers (``window`` tokens a query sees, itself
    included) plus ``full_to_swa [full_slots]`` (int64; 0, the padding sink, until mapped)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        full_slots: int,
        window: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fence: StepFence | None = None,
    ) -> None:
        super().__init__(num_layers, num_pages, page_size, kv_heads, head_dim, dtype, device, fence)
        self.window = window
        self.full_to_swa = torch.zeros(full_slots, dtype=torch.int64, device=device)

    def map(self, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> None:
        """Point ``full_slots`` at ``swa_slots`` (host index tensors of equal length)."""
        device = self.full_to_swa.device
        self.full_to_swa[full_slots.to(device, torch.int64)] = swa_slots.to(device, torch.int64)


@dataclass
class _Window:
    reserved: int  # pages reserved at admission
    tree_from: int  # page index: pages before it are the tree's
    positions: int  # the request's prompt + max new tokens
    pages: deque[tuple[int, torch.Tensor]] = field(default_factory=deque)  # (page, pool slots)
    pinned: int = 0  # the tree's pages its lock pins (counted against ``reserved``)


class SWAWindows:
    """Window pages of running requests, keyed by request id, in ``pool``."""

    def __init__(self, pool: SWAKVPool, prefill_chunk: int) -> None:
        self.pool = pool
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.prefill_chunk = prefill_chunk
        self.pages_per_request = self.worst_case_pages(pool.window, prefill_chunk, pool.page_size)
        self._held: dict[str, _Window] = {}

    @property
    def window(self) -> int:
        """The sliding window its pool was built for (the model contract's, at assembly)."""
        return self.pool.window

    @staticmethod
    def pool_pages(
        window: int, prefill_chunk: int, page_size: int, per_request_pools: int, budget_pages: int
    ) -> int:
        """Default size of the pool: ``per_request_pools`` worst-case windows (two per running
        request: the tree keeps windows too) within ``budget_pages``, never less than one
        request's window; plus the padding page."""
        one = SWAWindows.worst_case_pages(window, prefill_chunk, page_size)
        return max(one, min(per_request_pools * one, budget_pages)) + 1

    @staticmethod
    def check_pool(pages: int, window: int, prefill_chunk: int, page_size: int) -> None:
        one = SWAWindows.worst_case_pages(window, prefill_chunk, page_size)
        if pages - 1 < one:
            raise ValueError(
                f"kv_pool.swa_num_pages={pages} cannot hold one request's window ({one} "
                f"pages of sliding window {window} + scheduler.prefill_chunk); raise it"
            )

    @staticmethod
    def worst_case_pages(window: int, prefill_chunk: int, page_size: int) -> int:
        """Most pages one request holds: positions ``(start - window, start + chunk)``, whose
        two ends may each sit in a partial page, plus one freed page a launched step may still
        read while its successor allocates."""
        return -(-(window + prefill_chunk) // page_size) + 3

    def request_pages(self, positions: int, total_len: int, decoding: bool = False) -> int:
        """Most pages a request of ``positions`` (prompt + max new tokens) can hold from now on:
        while prefilling, its window plus a chunk no longer than its ``total_len``; while
        decoding, its window plus one."""
        chunk = 1 if decoding else min(self.prefill_chunk, max(1, total_len))
        worst = self.worst_case_pages(self.window, chunk, self.page_size)
        return min(worst, -(-positions // self.page_size) + 1)

    def shortfall(self, positions: int, total_len: int, pinned: int = 0) -> int:
        """Pages to free (evict from the tree) so the reservations of the running requests and
        of such a request (whose lock pins ``pinned`` pages) are free pages; <= 0: none."""
        owed = sum(max(0, w.reserved - len(w.pages) - w.pinned) for w in self._held.values())
        need = self.request_pages(positions, total_len) - pinned
        return owed + need - self.allocator.num_free_pages()

    def fits(self, positions: int, total_len: int) -> bool:
        """Whether the pool could ever hold such a request's window next to the others'."""
        reserved = sum(w.reserved for w in self._held.values())
        return reserved + self.request_pages(positions, total_len) <= self.allocator.num_pages - 1

    def shortfall_for(self, key: str, start: int, end: int) -> int:
        """Pages ``advance(key, ..., start, end, ...)`` would allocate beyond the free ones."""
        return self.pages_to_alloc(key, start, end) - self.allocator.num_free_pages()

    def pages_to_alloc(self, key: str, start: int, end: int) -> int:
        """Pages ``advance(key, ..., start, end, ...)`` allocates."""
        w = self._held[key]
        ps = self.page_size
        first = (
            w.pages[-1][0] + 1
            if w.pages
            else max(max(0, start - self.window + 1) // ps, w.tree_from)
        )
        return max(0, (end - 1) // ps - first + 1)

    def room(self, spans: list[tuple[str, int, int]]) -> bool:
        """Whether ``advance`` over every ``(key, start, end)`` finds its pages free now, with
        no eviction (whose frees wait for a step in flight)."""
        need = sum(self.pages_to_alloc(key, a, b) for key, a, b in spans)
        return need <= self.allocator.num_free_pages()

    def reserve(
        self, key: str, positions: int, total_len: int, cached: int, pinned: int = 0
    ) -> None:
        pages = self.request_pages(positions, total_len)
        self._held[key] = _Window(pages, cached // self.page_size, positions, pinned=pinned)

    def set_pinned(self, key: str, pages: int) -> None:
        """The tree's window pages request ``key``'s lock pins now (it moved or slid on)."""
        self._held[key].pinned = pages

    def advance(self, key: str, slots: torch.Tensor, start: int, end: int, total_len: int) -> None:
        """Before a step computes positions ``[start, end)`` of request ``key`` (whose full-pool
        ``slots`` they are): free the pages out of its window, allocate and map the pages of
        the new positions."""
        w = self._held[key]
        ps, pages = self.page_size, w.pages
        first_needed = max(0, start - self.window + 1) // ps
        dropped = []
        while pages and pages[0][0] < first_needed:
            dropped.append(pages.popleft()[1])
        if dropped:
            self.allocator.free(torch.cat(dropped))
        if end - start == 1 and start >= total_len - 1:
            # Decoding (a single position at the end; under lookahead ``total_len`` lags by
            # one): the chunk reserved for prefill is not needed again in this admission.
            decode = self.request_pages(w.positions, total_len, decoding=True)
            w.reserved = min(w.reserved, max(len(pages), decode) + w.pinned)
        next_page = pages[-1][0] + 1 if pages else max(first_needed, w.tree_from)
        last_page = (end - 1) // ps
        if last_page < next_page:
            return
        n = last_page - next_page + 1
        window = self.allocator.alloc(n * ps)
        if window is None:
            raise LedgerError(
                f"request {key!r}: the sliding-window pool has no free page although "
                "admission reserved them (pool ledger broken)"
            )
        full = slots[next_page * ps : (last_page + 1) * ps]
        self.pool.map(full, window[: full.numel()])
        for i in range(n):
            pages.append((next_page + i, window[i * ps : (i + 1) * ps]))

    def insert_value(self, key: str, n: int) -> tuple[torch.Tensor | None, int]:
        """``(swa_value, swa_from)`` for inserting request ``key``'s first ``n`` tokens: its
        window-pool slot per token, valid from its first held page on."""
        w = self._held.get(key)
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

    def hand_over(
        self, key: str, slots: torch.Tensor, aligned: int, taken: tuple[tuple[int, int], ...]
    ) -> None:
        """After an insert of request ``key``'s first ``aligned`` tokens: pages in ``taken`` are
        the tree's now (mapped from the full ``slots`` the request reads, which may be the
        tree's), the rest of those before ``aligned`` are duplicates or out of the window:
        freed."""
        w = self._held.get(key)
        if w is None:
            return
        ps, pages = self.page_size, w.pages
        freed = []
        while pages and (pages[0][0] + 1) * ps <= aligned:
            page, window = pages.popleft()
            a = page * ps
            if any(lo <= a and a + ps <= hi for lo, hi in taken):
                self.pool.map(slots[a : a + ps], window)
            else:
                freed.append(window)
        if freed:
            self.allocator.free(torch.cat(freed))
        w.tree_from = max(w.tree_from, aligned // ps)

    def release(self, key: str) -> None:
        w = self._held.pop(key, None)
        if w is not None and w.pages:
            self.allocator.free(torch.cat([slots for _, slots in w.pages]))

    def held_tokens(self, key: str) -> int:
        w = self._held.get(key)
        return 0 if w is None else len(w.pages) * self.page_size

    def used_tokens(self) -> int:
        """Pool tokens in use: held by requests, by the tree, or freed but still readable."""
        return self.allocator.capacity - self.allocator.available_size()

    def check(
        self, live: set[str], tree_held_tokens: int, pinned: dict[str, int] | None = None
    ) -> None:
        """Ledger: request-held + tree-held + free + pending-free == capacity; each request
        within its reservation with what its lock pins (``pinned``: pages, by request id, as
        the tree counts them now), and the reservations within the pool."""
        alloc = self.allocator
        alloc.check_invariants()
        held = sum(len(w.pages) for w in self._held.values()) * self.page_size
        total = held + tree_held_tokens + alloc.available_size() + alloc.pending_size()
        if total != alloc.capacity:
            raise AssertionError(
                f"sliding-window pool: request-held {held} + tree {tree_held_tokens} + free "
                f"{alloc.available_size()} + pending {alloc.pending_size()} != {alloc.capacity}"
            )
        if set(self._held) - live:
            raise AssertionError(f"sliding-window pool: pages held by {set(self._held) - live}")
        for rid, w in self._held.items():
            if pinned is not None and pinned.get(rid, 0) != w.pinned:
                raise AssertionError(
                    f"sliding-window pool: request {rid!r} is charged {w.pinned} pinned pages, "
                    f"its lock pins {pinned.get(rid, 0)}"
                )
            if len(w.pages) + w.pinned > w.reserved:
                raise AssertionError(
                    f"sliding-window pool: request {rid!r} holds {len(w.pages)} pages and pins "
                    f"{w.pinned}, reserved {w.reserved}"
                )
        reserved = sum(w.reserved for w in self._held.values())
        if reserved > alloc.num_pages - 1:
            raise AssertionError(
                f"sliding-window pool: reservations {reserved} exceed the pool's "
                f"{alloc.num_pages - 1} pages"
            )
