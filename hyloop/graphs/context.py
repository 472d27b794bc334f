"""The per-step context every layer reads: positions, slots, table rows, pools.

One object carries the step's metadata so layer signatures stay ``forward(x, ctx)``. In a
captured step every tensor here is a view of a static buffer updated in place; the only Python
values are static per bucket (``kv_len``, ``is_decode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepContext:
    """Metadata of one batched forward over a padded ``[B, T]`` token layout.

    Row ``b`` holds ``extend_lens[b]`` real new tokens (left-aligned; the rest is padding) of the
    request whose req->token row is ``req_rows[b]``. Padding rows have ``extend_lens == 0``,
    ``req_rows`` = the padding row, ``out_cache_loc`` = 0 (the padding sink) and state slot 0.
    """

    input_ids: torch.Tensor  # [B, T] int64 (token models) or [B, T, C] (multi-channel rows)
    positions: torch.Tensor  # [B, T] int64 absolute positions
    out_cache_loc: torch.Tensor  # [B, T] int64 KV slot each new token writes; padding -> 0
    req_rows: torch.Tensor  # [B] int64 row of req_to_token
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the KV before this step
    extend_lens: torch.Tensor  # [B] int64 real new tokens in this row (0 for padding rows)
    req_to_token: torch.Tensor  # [max_requests + 1, max_context] int32
    kv_len: int  # static: table columns attention reads (>= max(prefix + extend))
    kv: Any = None  # KVPool (per-layer .k / .v buffers)
    # Hybrid (recurrent) models.
    recurrent: Any = None  # RecurrentPool (per recurrent layer temporal / conv state)
    state_slots: torch.Tensor | None = None  # [B] int64 working state slot; padding -> 0
    track_slots: torch.Tensor | None = None  # [B] int64 track slot to publish into; 0 = none
    is_decode: bool = False  # static: every row has exactly one new token (T == 1)
    # Per-step values derived once and shared by every layer (RoPE rows, attention indices).
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    @property
    def last_index(self) -> torch.Tensor:
        """Index (within T) of each row's last real token; 0 for padding rows."""
        return (self.extend_lens - 1).clamp_min(0)
