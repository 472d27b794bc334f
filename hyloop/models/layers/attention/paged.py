"""Paged attention: write K/V at ``out_cache_loc``, read the context through req->token; and the
attention block every architecture here shares around it (``QKVAttention``: fused q/k/v
projection, optional q/k norms, RoPE, paged attention, optional sigmoid output gate, output
projection).

Which buffers a layer reads and writes and which key columns each query sees are the layer's
``view`` (``models.kv_layout``), placed from the model contract; the attention itself is the
step's compute path (``batch.pools.compute``: torch, compiled form or CPU kernel), chosen at
assembly.

NOTE: padded rows point at the padding request row (all slot 0) with position 0, so they see
exactly one key (the sink) and never produce NaN.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from hyloop.graphs.ops import write_kv
from hyloop.graphs.step_batch import StepBatch
from hyloop.models.kv_layout import AttentionMeta, KVView
from hyloop.models.layers.norm import RMSNorm
from hyloop.models.layers.rope import RotaryEmbedding


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


class QKVAttention(nn.Module):
    """``qkv_proj`` holds ``[q; k; v]`` stacked on rows (``gated``: each head's ``[q_h | gate_h]``
    for Qwen3-Next's ``attn * sigmoid(gate)``); ``qk_norm`` is a per-head RMSNorm of q and k,
    ``plain`` (Qwen3) or ``zero_centered`` (Gemma 3, Qwen3-Next). The scale defaults to
    ``head_dim ** -0.5``; which keys a query sees is the layer's KV view (the model contract's,
    ``models.kv_layout``)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        *,
        eps: float = 1e-6,
        scale: float | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Literal["plain", "zero_centered"] | None = None,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.gated = gated
        sizes = ((2 if gated else 1) * self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = nn.Linear(hidden, sum(sizes), bias=qkv_bias)
        self.qkv_proj.shard_sizes = sizes
        self.sizes = list(sizes)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:
            centred = qk_norm == "zero_centered"
            self.q_norm = RMSNorm(head_dim, eps, zero_centered=centred)
            self.k_norm = RMSNorm(head_dim, eps, zero_centered=centred)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, scale or head_dim**-0.5)

    @classmethod
    def of(cls, spec: Any, rotary: RotaryEmbedding, **options: Any) -> QKVAttention:
        """The block for an architecture's spec (``hidden_size``, ``num_heads``,
        ``num_kv_heads``, ``head_dim``, ``rms_norm_eps``) and its options."""
        return cls(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            rotary,
            eps=spec.rms_norm_eps,
            **options,
        )

    def _project(
        self, x: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``q [B,T,Hq,D]`` and ``k`` rotated, ``v [B,T,Hkv,D]``, and the output gate."""
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, batch)
        return q, k, v, gate

    def queries_keys_values(
        self, x: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [B, T, Hq, D]`` and K rotated, and V ``[B, T, Hkv, D]``, for ``x``."""
        q, k, v, _ = self._project(x, batch)
        return q, k, v

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, gate = self._project(x, batch)
        out = self.attn(q, k, v, batch)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, self.q_size))
        return self.o_proj(out)


__all__ = ["AttentionMeta", "PagedAttention", "QKVAttention"]
