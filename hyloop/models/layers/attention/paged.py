"""Paged attention: write K/V at ``out_cache_loc``, read the context through req->token.

Which buffers a layer reads and writes and which key columns each query sees are the layer's
``view`` (``models.kv_layout``), placed from the model contract; the attention itself is the
step's compute path (``batch.pools.compute``: torch, compiled form or CPU kernel), chosen at
assembly.

NOTE: padded rows point at the padding request row (all slot 0) with position 0, so they see
exactly one key (the sink) and never produce NaN.
"""

from __future__ import annotations

import torch
from torch import nn

from hyloop.graphs.ops import write_kv
from hyloop.graphs.step_batch import StepBatch
from hyloop.models.kv_layout import AttentionMeta, KVView


class PagedAttention(nn.Module):
    """Scaled dot-product attention over one layer's buffers of the paged KV pool."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Layer 0 of the full pool, all keys; placed from the model's contract (``contract_of``).
        self.view = KVView()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """``q [B,T,Hq,D]``, ``k``/``v [B,T,Hkv,D]`` -> ``[B,T,Hq*D]``."""
        t = q.shape[1]
        k_buf, v_buf = self.view.buffers(batch)
        meta = self.view.meta(batch)
        write_kv(k_buf, v_buf, meta.loc, k, v)
        compute = batch.pools.compute
        if t == 1:
            return compute.decode(self, q, k_buf, v_buf, meta, batch)
        return compute.prefill(self, q, k_buf, v_buf, meta, batch)


__all__ = ["AttentionMeta", "PagedAttention"]
