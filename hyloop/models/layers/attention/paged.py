"""Paged attention: write K/V at ``out_cache_loc``, read the context through req->token, and the
compute paths that attention (and a sampler's top-k) runs on, chosen at assembly.

Which buffers a layer reads and writes and which key columns each query sees are the layer's
``view`` (``models.kv_layout``), placed from the model contract. A step carries its compute path
in ``batch.pools.compute``; an engine has two, one for eager steps and one for captured steps,
which differ only in speed:

* ``TorchPath``: plain torch ops. Decode does not use SDPA: one query row per sequence is
  faster as two matmuls and a softmax in fp32 (CPU: one batched matmul pair per kv head, over
  views of the gathered rows that BLAS reads in place). Eager CPU steps gather every layer's
  context into the same two step-scratch buffers.
* ``CompiledPath``: what inductor should see: the decode as two multiply-reduces over the rows
  as they lie in the pool, each fused with its gather.
* ``NativePath`` (CPU): hyloop's C++ kernels, eager and compiled alike: decode attention over
  the visible pool rows in place, a sampler's small top-k; where they are not loaded, the same
  operators' torch definitions (``models.cpu.numerics``: the same bits, slower).

``bench/decode_step.py`` times the paths against each other.

NOTE: padded rows point at the padding request row (all slot 0) with position 0, so they see
exactly one key (the sink) and never produce NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyloop.graphs.ops import write_kv
from hyloop.graphs.step_batch import StepBatch
from hyloop.models.cpu import numerics
from hyloop.models.kv_layout import AttentionMeta, KVView

F32 = torch.float32


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


class TorchPath:
    """Plain torch ops (the eager path, and CUDA graphs without a compile inside)."""

    topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None  # fp32 [B, V] -> [B]
    # A model's decoder layers as one call for decode steps (``models.cpu.DecoderStack``).
    stack: Any = None

    def gather(
        self, batch: StepBatch, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's K and V rows ``[B*L, Hkv, D]``, in the pool's layout."""
        if k_buf.device.type != "cpu":
            return k_buf.index_select(0, slots), v_buf.index_select(0, slots)
        # A fresh multi-MB tensor per layer costs more in page faults than the copy itself.
        key = ("gather", k_buf.dtype, slots.numel(), tuple(k_buf.shape[1:]))
        bufs = batch.meta.get(key)
        if bufs is None:
            shape = (slots.numel(), *k_buf.shape[1:])
            bufs = batch.meta[key] = (k_buf.new_empty(shape), v_buf.new_empty(shape))
        torch.index_select(k_buf, 0, slots, out=bufs[0])
        torch.index_select(v_buf, 0, slots, out=bufs[1])
        return bufs

    def context(
        self,
        layer: PagedAttention,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttentionMeta,
        batch: StepBatch,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The rows ``meta`` selects as ``[B, L, Hkv, D]`` keys and values, and ``L``."""
        b = meta.loc.shape[0]
        length = meta.slots.numel() // b
        keys, values = self.gather(batch, k_buf, v_buf, meta.slots)
        shape = (b, length, layer.num_kv_heads, layer.head_dim)
        return keys.view(shape), values.view(shape), length

    def prefill(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttentionMeta,
        batch: StepBatch,
    ) -> torch.Tensor:
        """``q [B,T,Hq,D]`` over the rows ``meta`` selects, causally -> ``[B,T,Hq*D]``."""
        b, t = q.shape[:2]
        keys, values, _ = self.context(layer, k_buf, v_buf, meta, batch)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.mask,
            scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(b, t, layer.num_heads * layer.head_dim)

    def decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttentionMeta,
        batch: StepBatch,
    ) -> torch.Tensor:
        """One query per row: ``q [B,1,Hq,D]`` over the rows ``meta`` selects -> ``[B,1,Hq*D]``."""
        b, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        keys, values, length = self.context(layer, k_buf, v_buf, meta, batch)
        group = layer.num_heads // hkv
        q32 = q.reshape(b, hkv, group, d).to(F32)  # query head h reads kv head h // group
        if keys.device.type == "cpu":
            # bmm reads each head's [B,L,D] view in place (no head-major copy of K and V).
            keys, values = keys.to(F32), values.to(F32)
            scores = torch.stack(
                [torch.bmm(q32[:, h], keys[:, :, h].transpose(1, 2)) for h in range(hkv)], 1
            )
            bias = meta.mask.view(b, 1, 1, length)
            probs = torch.softmax(scores.mul_(layer.scale).add_(bias), dim=-1)
            out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(hkv)], 1)
            return out.to(q.dtype).reshape(b, 1, layer.num_heads * d)
        k32 = keys.transpose(1, 2).to(F32, memory_format=torch.contiguous_format)
        v32 = values.transpose(1, 2).to(F32, memory_format=torch.contiguous_format)
        scores = torch.matmul(q32, k32.transpose(-1, -2)).mul_(layer.scale).add_(meta.mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), v32).to(q.dtype)  # [B,Hkv,G,D]
        return out.reshape(b, 1, layer.num_heads * d)

    def local(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        """A frame's local attention: ``q [B, H, D]`` over positions ``0..pos`` of its
        ``[B, P, H, D]`` caches -> ``[B, H * D]``."""
        b, _, h, d = k_cache.shape
        keys = k_cache[:, : pos + 1].transpose(1, 2).float()  # [B, H, L, D]
        values = v_cache[:, : pos + 1].transpose(1, 2).float()
        scores = torch.matmul(q.float().unsqueeze(2), keys.transpose(-1, -2))
        probs = torch.softmax(scores * d**-0.5, dim=-1)  # [B, H, 1, L]
        return torch.matmul(probs, values).to(q.dtype).reshape(b, h * d)


class CompiledPath(TorchPath):
    """The form inductor fuses best (torch.compile'd steps without the CPU kernels; off the CPU
    only, so its gather is ``TorchPath``'s plain ``index_select``)."""

    def decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttentionMeta,
        batch: StepBatch,
    ) -> torch.Tensor:
        # Multiply-reduces over the rows as they lie in the pool ([L, Hkv, D]): inductor fuses
        # each gather into its reduction, where the matmul form would materialise K transposed.
        b, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        keys, values, length = self.context(layer, k_buf, v_buf, meta, batch)
        q32 = q.reshape(b, 1, hkv, layer.num_heads // hkv, d).to(F32)
        scores = (q32 * keys.unsqueeze(3).to(F32)).sum(-1) * layer.scale
        probs = torch.softmax(scores + meta.mask.view(b, length, 1, 1), dim=1)  # [B,L,Hkv,G]
        out = (probs.unsqueeze(-1) * values.unsqueeze(3).to(F32)).sum(1)
        return out.to(q.dtype).reshape(b, 1, layer.num_heads * d)


class NativePath(TorchPath):
    """hyloop's CPU kernels (``models.cpu.cpu_ops``): reads the visible pool rows in place;
    with ``stack``, a dense model's decode steps run its layers as one call. ``native=False``:
    the kernels are not loaded, and their torch definitions run instead."""

    def __init__(self, stack: Any = None, native: bool = True) -> None:
        self.stack = stack
        self.attend = torch.ops.hyloop.decode_attention if native else numerics.attention_op
        self.topk = torch.ops.hyloop.topk_rows if native else numerics.topk
        self.argmax = torch.ops.hyloop.argmax_rows if native else None

    def prefill(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttentionMeta,
        batch: StepBatch,
    ) -> torch.Tensor:
        """Every query position as a row of the decode kernel, over its visible columns only:
        a position's result is the one a decode step would compute for it, whatever the
        padding of the batch it shares (SDPA's blocking follows the padded lengths)."""
        b, t, _, d = q.shape
        length = meta.slots.numel() // b
        key = ("prefill rows", id(meta))
        rows = batch.meta.get(key)
        if rows is None:
            slots = meta.slots.view(b, 1, length).expand(b, t, length).reshape(b * t, length)
            zero = torch.zeros((), dtype=F32, device=q.device)
            bias = torch.where(meta.mask.view(b * t, length), zero, float("-inf"))
            rows = batch.meta[key] = (slots.contiguous(), bias)
        out = self.attend(
            q.reshape(b * t, layer.num_heads, d), k_buf, v_buf, rows[0], rows[1], layer.scale
        )
        return out.view(b, t, layer.num_heads * d)

    def decode(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttentionMeta,
        batch: StepBatch,
    ) -> torch.Tensor:
        b, d = q.shape[0], layer.head_dim
        out = self.attend(
            q.reshape(b, layer.num_heads, d),
            k_buf,
            v_buf,
            meta.slots.view(b, -1),
            meta.mask.view(b, -1),
            layer.scale,
        )
        return out.view(b, 1, layer.num_heads * d)

    def local(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        # The frame caches read as a pool whose slot ``b * P + p`` is row b's position p.
        b, positions, h, d = k_cache.shape
        slots = torch.arange(b, device=q.device).view(b, 1) * positions + torch.arange(
            pos + 1, device=q.device
        )
        bias = torch.zeros(b, pos + 1, dtype=F32, device=q.device)
        flat = (b * positions, h, d)
        out = self.attend(q, k_cache.view(flat), v_cache.view(flat), slots, bias, d**-0.5)
        return out.reshape(b, h * d)


def compute_paths(
    device: torch.device, native: bool, compiled: bool, stack: Any = None
) -> tuple[Any, Any]:
    """``(eager, captured)`` paths: on CPU the kernels for both (with the model's decoder
    ``stack``, if it has one), or their torch definitions where they are not loaded; elsewhere
    torch ops for eager steps and, when the captured step is compiled, the form inductor
    fuses."""
    if device.type == "cpu":
        path = NativePath(stack, native)
        return path, path
    eager = TorchPath()
    return eager, CompiledPath() if compiled else eager
