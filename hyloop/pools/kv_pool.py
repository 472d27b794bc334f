"""Paged KV pool: per-layer K and V buffers of ``[num_slots, kv_heads, head_dim]``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hyloop.pools.page_allocator import PageAllocator
from hyloop.pools.step_fence import StepFence

if TYPE_CHECKING:
    from hyloop.pools.swa_pool import SWAKVPool


class KVPool:
    """Per-layer K/V buffers plus the page allocator that owns their slots.

    NOTE: buffers are separate per layer and written with ``index_copy_`` on the buffer itself,
    so a compiled step keeps the write in place instead of copying a multi-layer tensor.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fence: StepFence | None = None,
    ) -> None:
        self.allocator = PageAllocator(num_pages, page_size, device, fence)
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Sliding-window layers' own pool, when the model has them and they are pooled apart.
        self.swa: SWAKVPool | None = None

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
