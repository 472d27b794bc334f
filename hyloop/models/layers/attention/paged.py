"""Paged attention: write K/V at ``out_cache_loc``, read the context through req->token.

Keys of row ``b`` are the first ``kv_len`` columns of its req->token row; key column ``j`` (=
absolute position ``j``) is visible to a query at position ``p`` iff ``j <= p`` and, on a
sliding-window layer, ``j > p - window``. Prefill masks those columns; a decode step whose
``kv_len`` exceeds the window reads only the window's columns of each row (a static
``[B, window]`` gather), so its cost stops growing with the context. The decode itself is the
step's compute path (``batch.pools.compute``: torch, compiled form or CPU kernel), chosen at
assembly.

NOTE: padded rows point at the padding request row (all slot 0) with position 0, so they see
exactly one key (the sink) and never produce NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyloop.graphs.ops import write_kv
from hyloop.graphs.step_batch import StepBatch


@dataclass
class AttentionMeta:
    """Per step and window, shared by the layers: context slots and what each row sees."""

    slots: torch.Tensor  # [B * L] KV slots of the columns read
    mask: torch.Tensor  # prefill: bool [B, 1, T, L]; decode: fp32 bias [B, 1, 1, L] (0 / -inf)
    loc: torch.Tensor  # [B, T] slots the new tokens write


class PagedAttention(nn.Module):
    """Scaled dot-product attention over one layer's buffers of the paged KV pool."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        # The buffers this layer owns: layer ``pool_layer`` of the full pool, or of the
        # sliding-window pool when ``in_swa_pool`` (``place_kv_layers`` sets both).
        self.pool_layer = 0
        self.in_swa_pool = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """``q [B,T,Hq,D]``, ``k``/``v [B,T,Hkv,D]`` -> ``[B,T,Hq*D]``."""
        b, t = q.shape[:2]
        pool = batch.pools.kv.swa if self.in_swa_pool else batch.pools.kv
        k_buf, v_buf = pool.k[self.pool_layer], pool.v[self.pool_layer]
        meta = attention_meta(batch, self.window, self.in_swa_pool)
        write_kv(k_buf, v_buf, meta.loc, k, v)
        compute = batch.pools.compute
        if t == 1:
            return compute.decode(self, q, k_buf, v_buf, meta, batch)
        return compute.prefill(self, q, k_buf, v_buf, meta, batch)


def attention_meta(batch: StepBatch, window: int | None, in_swa_pool: bool) -> AttentionMeta:
    """The step's ``AttentionMeta`` for one window, built by the first layer that needs it."""
    key = ("attention", window, in_swa_pool)
    meta = batch.meta.get(key)
    if meta is None:
        meta = batch.meta[key] = _build_meta(batch, window, in_swa_pool)
    return meta


def _build_meta(batch: StepBatch, window: int | None, in_swa_pool: bool) -> AttentionMeta:
    b, t = batch.positions.shape
    device = batch.positions.device
    table = batch.pools.req_to_token
    zero = torch.zeros((), dtype=torch.float32, device=device)
    if window is not None and t == 1 and batch.kv_len > window:
        # Decode on a sliding layer reads only its window, columns (p - window, p] of each row
        # (static shape [B, window]; columns before 0 are masked and read slot 0).
        cols = batch.positions.view(b, 1) - (window - 1) + torch.arange(window, device=device)
        rows = batch.req_rows.view(b, 1)
        slots = table[rows, cols.clamp(min=0)].reshape(-1).long()
        mask = torch.where(cols >= 0, zero, float("-inf")).view(b, 1, 1, window)
    else:
        slots = table[batch.req_rows, : batch.kv_len].reshape(-1).long()
        cols = torch.arange(batch.kv_len, device=device).view(1, 1, 1, -1)
        pos = batch.positions.view(b, 1, t, 1)
        visible = cols <= pos
        if window is not None:
            visible = visible & (cols > pos - window)
        mask = torch.where(visible, zero, float("-inf")) if t == 1 else visible
    loc = batch.out_cache_loc
    if in_swa_pool:  # token identity is the full-pool slot: translate into the window pool
        full_to_swa = batch.pools.kv.swa.full_to_swa
        loc = full_to_swa.index_select(0, loc.reshape(-1)).view(loc.shape)
        slots = full_to_swa.index_select(0, slots)
    return AttentionMeta(slots, mask, loc)


def place_kv_layers(model: nn.Module, swa_pool: bool) -> tuple[int, int]:
    """Give each attention layer of ``model`` (in order) its buffers: with ``swa_pool`` the
    sliding-window layers live in the sliding-window pool and the full pool holds the rest.
    Returns the layer counts of (full pool, sliding-window pool)."""
    full = swa = 0
    for attn in model.modules():
        if isinstance(attn, PagedAttention):
            attn.in_swa_pool = swa_pool and attn.window is not None
            if attn.in_swa_pool:
                attn.pool_layer, swa = swa, swa + 1
            else:
                attn.pool_layer, full = full, full + 1
    return full, swa
