"""Page allocator for the paged KV pool.

Slots are grouped into pages of ``page_size``; the allocator hands out whole pages. Page 0 is
reserved as the padding sink: padded rows of a captured step write there and nothing reads it.
"""

from __future__ import annotations

import torch


class PageAllocator:
    """Hands out whole pages of KV slots; page 0 is never handed out.

    ``alloc(n)`` returns the slot indices of ``ceil(n / page_size)`` pages (all their slots, in
    page order), so the caller owns whole pages. ``free(indices)`` returns the pages those slots
    belong to; a page may be freed only by the one owner that holds it.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the padding sink), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free_pages: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray(num_pages)
        for p in self._free_pages:
            self._is_free[p] = 1
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)

    # -- capacity -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Usable token slots (page 0 excluded)."""
        return (self.num_pages - 1) * self.page_size

    def available_size(self) -> int:
        """Free token slots."""
        return len(self._free_pages) * self.page_size

    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- alloc / free ---------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slot indices of enough whole pages for ``num_tokens``; None when the pool is short."""
        if num_tokens <= 0:
            return torch.empty(0, dtype=torch.int64)
        n = self.pages_for(num_tokens)
        if n > len(self._free_pages):
            return None
        pages = self._free_pages[-n:]
        del self._free_pages[-n:]
        for p in pages:
            self._is_free[p] = 0
        if self.page_size == 1:
            return torch.tensor(pages, dtype=torch.int64)
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (base[:, None] + self._page_offsets[None, :]).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        """Return the pages that ``indices`` cover. Freeing a free page or page 0 is an error."""
        if indices.numel() == 0:
            return
        if self.page_size == 1:
            pages = indices.tolist()
        else:
            pages = torch.unique(indices // self.page_size).tolist()
        is_free = self._is_free
        for p in pages:
            if p <= 0 or p >= self.num_pages:
                raise ValueError(f"free of slot in page {p}: outside 1..{self.num_pages - 1}")
            if is_free[p]:
                raise ValueError(f"double free of page {p}")
        for p in pages:
            is_free[p] = 1
        self._free_pages.extend(pages)

    def free_page_ids(self) -> set[int]:
        return set(self._free_pages)

    def check_invariants(self) -> None:
        free = self._free_pages
        if len(set(free)) != len(free):
            raise AssertionError("page allocator: duplicate page in the free list")
        if 0 in free:
            raise AssertionError("page allocator: the padding page 0 is in the free list")
        if sum(self._is_free) != len(free):
            raise AssertionError("page allocator: free bitmap and free list disagree")
