"""The sliding-window KV pool: K/V of sliding-window layers, for the window of each request only.

A token's identity stays its slot in the full pool (the req->token table, ``out_cache_loc`` and
the radix tree hold full-pool slots); ``full_to_swa`` translates a full slot into the slot that
holds the same token on the sliding layers (sglang's full->swa index mapping). The translation
is a device tensor the captured step gathers through, so which pages are live never changes a
shape.

NOTE: freed pages keep their stale entries in ``full_to_swa``: a launched step may still read
them, and every later reader masks those positions out (they lie outside its window) or sees
them re-pointed when the full slot is reused and its token computed again.
"""

from __future__ import annotations

import torch

from hyloop.pools.kv_pool import KVPool
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
