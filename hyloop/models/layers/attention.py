"""Paged attention: write K/V at ``out_cache_loc``, read the context through req->token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyloop.graphs.context import StepContext


class PagedAttention(nn.Module):
    """Scaled dot-product attention over the paged KV pool of one layer.

    Keys of row ``b`` are the first ``ctx.kv_len`` columns of its req->token row; key column
    ``j`` (= absolute position ``j``) is visible to a query at position ``p`` iff ``j <= p``.
    NOTE: padded rows point at the padding request row (all slot 0) with position 0, so they
    see exactly one key (the sink) and never produce NaN.
    """

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """``q [B,T,Hq,D]``, ``k``/``v [B,T,Hkv,D]`` -> ``[B,T,Hq*D]``."""
        b, t = q.shape[:2]
        k_buf, v_buf = ctx.kv.k[self.layer_id], ctx.kv.v[self.layer_id]
        loc = ctx.out_cache_loc.reshape(-1)
        k_buf.index_copy_(0, loc, k.reshape(-1, self.num_kv_heads, self.head_dim))
        v_buf.index_copy_(0, loc, v.reshape(-1, self.num_kv_heads, self.head_dim))

        meta = ctx.scratch.get("paged_attention")
        if meta is None:  # once per step, shared by every attention layer
            slots = ctx.req_to_token[ctx.req_rows, : ctx.kv_len].long()  # [B, L]
            cols = torch.arange(ctx.kv_len, device=q.device)
            mask = cols.view(1, 1, 1, -1) <= ctx.positions.view(b, 1, t, 1)  # [B, 1, T, L]
            meta = ctx.scratch["paged_attention"] = (slots, mask)
        slots, mask = meta
        keys = k_buf[slots].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_buf[slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
