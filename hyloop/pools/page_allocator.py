"""KV slots and the table that maps requests' positions to them: the page allocator of the paged
KV pool and the req->token table (one row of KV slot indices per running request).

Page 0 is reserved as the padding sink: padded rows of a captured step write there and nothing
reads it.
"""

from __future__ import annotations

import numpy as np
import torch

from hyloop.pools.step_fence import DeferredFrees, StepFence


class PageAllocator:
    """Hands out whole pages of ``page_size`` KV slots (never page 0).

    ``alloc(n)`` returns every slot of ``ceil(n / page_size)`` pages in page order, so the caller
    owns whole pages; ``free(indices)`` returns the pages of those slots, and only the one owner
    holding a page may free it.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        fence: StepFence | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the padding sink), got {num_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # LIFO free stack ``_stack[:_top]`` so recently freed (cache-warm) pages are reused first;
        # numpy keeps alloc/free vectorized, as the radix cache frees many slots per insert/evict.
        self._stack = np.zeros(num_pages, dtype=np.int64)
        self._stack[: num_pages - 1] = np.arange(num_pages - 1, 0, -1, dtype=np.int64)
        self._top = num_pages - 1
        # NOTE: page 0 reads as free (so freeing it trips the double-free check) but is never
        # on the stack.
        self._is_free = np.ones(num_pages, dtype=np.bool_)
        self._mark = np.zeros(num_pages, dtype=np.int64)
        self._order = np.arange(num_pages, dtype=np.int64)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        # Pages freed while a launched step may still read them wait here (``StepFence``).
        self.fence = fence
        self._pending: DeferredFrees[np.ndarray] = DeferredFrees()
        self._is_pending = np.zeros(num_pages, dtype=np.bool_)
        if fence is not None:
            fence.attach(self.flush_pending, self._pending)

    # -- capacity -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Usable token slots (page 0 excluded)."""
        return (self.num_pages - 1) * self.page_size

    def available_size(self) -> int:
        return self._top * self.page_size

    def num_free_pages(self) -> int:
        return self._top

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- alloc / free ---------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slot indices of enough whole pages for ``num_tokens``; None when the pool is short."""
        if num_tokens <= 0:
            return torch.empty(0, dtype=torch.int64)
        n = self.pages_for(num_tokens)
        if n > self._top:
            return None
        top = self._top - n
        pages = torch.from_numpy(self._stack[top : self._top].copy())
        self._top = top
        self._is_free[pages.numpy()] = False
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._page_offsets[None, :]).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return the pages that ``indices`` cover. Freeing a free page or page 0 is an error."""
        if indices.numel() == 0:
            return
        if indices.dtype == torch.int64 and indices.device.type == "cpu":
            idx = indices.numpy()
        else:
            idx = indices.detach().to("cpu", torch.int64).numpy()
        idx = idx.reshape(-1)
        pages = idx if self.page_size == 1 else idx // self.page_size
        if self.page_size > 1 and len(pages) > 1:
            # Slots of one page usually come in a run; keep the first of each run.
            keep = np.empty(len(pages), dtype=np.bool_)
            keep[0] = True
            np.not_equal(pages[1:], pages[:-1], out=keep[1:])
            pages = pages[keep]
        # Viewed unsigned, a negative page is huge: one max() checks both ends of the range.
        if int(pages.view(np.uint64).max()) >= self.num_pages or len(pages) >= self.num_pages:
            raise ValueError(
                f"free of slots {_describe(idx)}: pages outside 1..{self.num_pages - 1} "
                f"or more pages than the pool holds"
            )
        # Repeats without sorting: a repeated page's earlier position reads back the later one
        # from ``_mark``. Page 0 reads as free, so freeing it is caught here as well.
        order = self._order[: len(pages)]
        mark = self._mark
        mark[pages] = order
        if ((mark[pages] != order) | self._is_free[pages] | self._is_pending[pages]).any():
            if self.page_size > 1 and not (self._is_free[pages] | self._is_pending[pages]).any():
                pages = np.unique(pages)  # one page's slots given out of order: not an error
            else:
                self._raise_bad_free(pages)
        gen = self.fence.defer_gen if self.fence is not None else None
        if gen is not None:
            self._is_pending[pages] = True
            self._pending.park(gen, pages.copy())
            return
        self._push(pages)

    def _push(self, pages: np.ndarray) -> None:
        self._is_free[pages] = True
        top = self._top
        self._stack[top : top + len(pages)] = pages
        self._top = top + len(pages)

    # -- deferred frees -------------------------------------------------------------------------
    def flush_pending(self, through: int | None = None) -> int:
        """Release pending pages of generations ``<= through`` (all when None); returns pages.

        Only the fence should call this, as steps retire (a test calls it early on purpose)."""
        released = 0
        for pages in self._pending.take_through(through):
            self._is_pending[pages] = False
            self._push(pages)
            released += len(pages)
        return released

    def pending_size(self) -> int:
        """Token slots freed but not yet reusable."""
        return int(self._is_pending.sum()) * self.page_size

    def is_free_page(self, pages: np.ndarray) -> np.ndarray:
        """Which of ``pages`` are on the free list (reusable now)."""
        return self._is_free[pages]

    def free_page_ids(self) -> set[int]:
        return set(self._stack[: self._top].tolist())

    def check_invariants(self) -> None:
        """O(pages) with no sort: pools are large and the tests run this every step."""
        free = self._stack[: self._top]
        if len(free) and int(np.bincount(free, minlength=self.num_pages).max()) > 1:
            raise AssertionError("page allocator: duplicate page in the free list")
        if (free == 0).any():
            raise AssertionError("page allocator: the padding page 0 is in the free list")
        # No duplicates, every listed page marked and as many marks as pages: the same set.
        marks = int(self._is_free.sum()) - 1
        if marks != len(free) or not self._is_free[0] or not self._is_free[free].all():
            raise AssertionError("page allocator: free bitmap and free list disagree")
        if (self._is_free & self._is_pending).any():
            raise AssertionError("page allocator: a page is both free and pending-free")
        if sum(len(p) for p in self._pending.items()) != int(self._is_pending.sum()):
            raise AssertionError("page allocator: pending list and pending bitmap disagree")

    def _raise_bad_free(self, pages: np.ndarray) -> None:
        if (pages == 0).any():
            raise ValueError(f"free of slot in page 0: outside 1..{self.num_pages - 1}")
        already = self._is_free[pages] | self._is_pending[pages]
        if already.any():
            page = int(pages[already.argmax()])
            state = "pending free" if self._is_pending[page] else "free"
            raise ValueError(f"double free of page {page} (already {state})")
        values, counts = np.unique(pages, return_counts=True)
        raise ValueError(f"double free of page {int(values[counts > 1][0])} (repeated in one call)")


def _describe(idx: np.ndarray) -> str:
    head = idx[:8].tolist()
    return f"{head}{'...' if len(idx) > 8 else ''}"


class ReqToTokenPool:
    """``[max_requests + 1, max_context]`` int32: row ``r`` column ``p`` is the KV slot of
    position ``p`` of row ``r``'s request. The last row, for padding, stays all zeros (slot 0,
    the padding sink)."""

    def __init__(
        self,
        max_requests: int,
        max_context: int,
        device: torch.device | str,
        fence: StepFence | None = None,
    ) -> None:
        if max_requests < 1 or max_context < 1:
            raise ValueError("max_requests and max_context must be >= 1")
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = torch.zeros(max_requests + 1, max_context, dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        # Rows freed while a launched step may read them wait for it (``StepFence``).
        self.fence = fence
        self._pending: DeferredFrees[int] = DeferredFrees()
        self._parked: set[int] = set()  # the rows in ``_pending``
        if fence is not None:
            fence.attach(self.flush_pending, self._pending)

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Free ``row`` now, or once the steps that may read it retire (``StepFence``)."""
        bad = not 0 <= row < self.max_requests or row in self._free_rows
        if bad or row in self._parked:
            raise ValueError(f"req_to_token: bad free of row {row}")
        gen = self.fence.defer_gen if self.fence is not None else None
        if gen is not None:
            self._pending.park(gen, row)
            self._parked.add(row)
        else:
            self._free_rows.append(row)

    def flush_pending(self, through: int | None = None) -> int:
        """Free pending rows of generations ``<= through`` (all when None)."""
        done = self._pending.take_through(through)
        self._parked.difference_update(done)
        self._free_rows.extend(done)
        return len(done)

    def pending_size(self) -> int:
        return len(self._pending)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(self.table.dtype)

    def check_invariants(self) -> None:
        if len(set(self._free_rows)) != len(self._free_rows):
            raise AssertionError("req_to_token: duplicate free row")
        if self._parked != set(self._pending.items()):
            raise AssertionError("req_to_token: parked rows and the pending list disagree")
        if bool(self.table[self.padding_row].any()):
            raise AssertionError("req_to_token: padding row was written")
