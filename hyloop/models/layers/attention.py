"""Paged attention: write K/V at ``out_cache_loc``, read the context through req->token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyloop.graphs.context import StepContext
from hyloop.graphs.ops import write_kv


class PagedAttention(nn.Module):
    """Scaled dot-product attention over the paged KV pool of one layer.

    Keys of row ``b`` are the first ``ctx.kv_len`` columns of its req->token row; key column
    ``j`` (= absolute position ``j``) is visible to a query at position ``p`` iff ``j <= p``
    and, on a sliding-window layer, ``j > p - sliding_window`` (a mask over the same columns
    in prefill; a decode step whose ``kv_len`` exceeds the window reads only the window's
    columns of each row, a static ``[B, window]`` gather, so its cost stops growing with the
    context).
    NOTE: padded rows point at the padding request row (all slot 0) with position 0, so they
    see exactly one key (the sink) and never produce NaN.

    Decode (one query per row) does not use SDPA: on CPU its flash kernel costs ~1 ms per layer
    for a single query row in bf16 (~0.3 ms in fp32), several times the two grouped matmuls and
    softmax below, which run in fp32 whatever the pool dtype. With ``native_decode`` (CPU, the
    ``cpu_ops`` kernel loaded) decode runs ``hyloop::decode_attention`` instead, eager and
    compiled alike: it reads the visible pool rows in place.
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Which buffers this layer owns: ``pool_layer`` indexes the full pool's layers, or the
        # sliding-window pool's when ``in_swa_pool`` (the model's ``place_kv_layers`` sets both).
        self.pool_layer = layer_id
        self.in_swa_pool = False
        # CPU decode through ``hyloop::decode_attention`` (``cpu_ops``), set at assembly when
        # the kernel is loaded.
        self.native_decode = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """``q [B,T,Hq,D]``, ``k``/``v [B,T,Hkv,D]`` -> ``[B,T,Hq*D]``."""
        b, t = q.shape[:2]
        hkv, d = self.num_kv_heads, self.head_dim
        slots, mask = self._step_meta(ctx, b, t, q.device, self.sliding_window)
        if self.in_swa_pool:
            swa = ctx.kv.swa
            k_buf, v_buf = swa.k[self.pool_layer], swa.v[self.pool_layer]
            loc, slots = self._swa_slots(ctx, slots, self.sliding_window)
        else:
            k_buf, v_buf = ctx.kv.k[self.pool_layer], ctx.kv.v[self.pool_layer]
            loc = ctx.out_cache_loc
        write_kv(k_buf, v_buf, loc, k, v)
        if t == 1 and self.native_decode:
            # The pool rows are read in place, visible columns only: no gather.
            out = torch.ops.hyloop.decode_attention(
                q.reshape(b, self.num_heads, d),
                k_buf,
                v_buf,
                slots.view(b, -1),
                mask.view(b, -1),
                self.scale,
            )
            return out.view(b, 1, self.num_heads * d)

        keys, values = self._gather(ctx, k_buf, v_buf, slots)
        length = slots.numel() // b  # kv_len, or the window on a sliding layer's decode
        keys, values = keys.view(b, length, hkv, d), values.view(b, length, hkv, d)
        if t == 1:
            return self._decode(q, keys, values, mask)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != hkv,
        )
        return out.transpose(1, 2).reshape(b, t, self.num_heads * d)

    @staticmethod
    def _step_meta(
        ctx: StepContext, b: int, t: int, device: torch.device, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat context slots ``[B*L]`` and the mask, built once per step for every layer (one
        mask per window size).

        The mask is boolean ``[B,1,T,L]`` for prefill and an additive fp32 bias ``[B,1,1,L]``
        (0 or -inf) for decode.
        """
        key = "paged_attention" if window is None else f"paged_attention_w{window}"
        meta = ctx.scratch.get(key)
        if meta is None and window is not None and t == 1 and ctx.kv_len > window:
            # Decode on a sliding layer reads only its window, columns (p - window, p] of each
            # row (static shape [B, window]; columns before 0 are masked and read slot 0).
            offsets = torch.arange(window, device=device).view(1, -1)
            cols = ctx.positions.view(b, 1).long() - (window - 1) + offsets
            rows = ctx.req_rows.view(b, 1).long()
            slots = ctx.req_to_token[rows, cols.clamp(min=0)].reshape(-1).long()
            zero = torch.zeros((), dtype=torch.float32, device=device)
            mask = torch.where(cols >= 0, zero, float("-inf")).view(b, 1, 1, window)
            meta = ctx.scratch[key] = (slots, mask)
        if meta is None:
            slots = ctx.req_to_token[ctx.req_rows, : ctx.kv_len].reshape(-1).long()
            cols = torch.arange(ctx.kv_len, device=device).view(1, 1, 1, -1)
            pos = ctx.positions.view(b, 1, t, 1)
            visible = cols <= pos
            if window is not None:
                visible = visible & (cols > pos - window)
            if t == 1:
                zero = torch.zeros((), dtype=torch.float32, device=device)
                mask = torch.where(visible, zero, float("-inf"))
            else:
                mask = visible
            meta = ctx.scratch[key] = (slots, mask)
        return meta

    @staticmethod
    def _gather(
        ctx: StepContext, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's K and V rows ``[B*L, Hkv, D]``, in the pool's layout.

        index_select on the flat slot list is ~5x faster than advanced indexing on CPU. Eager
        CPU steps gather every layer into the same two step-scratch buffers: a fresh multi-MB
        tensor per layer costs more in page faults than the copy itself (CUDA's caching
        allocator has no such cost).
        """
        if torch.compiler.is_compiling() or k_buf.device.type != "cpu":
            return k_buf.index_select(0, slots), v_buf.index_select(0, slots)
        key = f"paged_attention_gather_{k_buf.dtype}_{slots.numel()}_{tuple(k_buf.shape[1:])}"
        bufs = ctx.scratch.get(key)
        if bufs is None:
            shape = (slots.numel(), *k_buf.shape[1:])
            bufs = ctx.scratch[key] = (k_buf.new_empty(shape), v_buf.new_empty(shape))
        torch.index_select(k_buf, 0, slots, out=bufs[0])
        torch.index_select(v_buf, 0, slots, out=bufs[1])
        return bufs

    @staticmethod
    def _swa_slots(
        ctx: StepContext, slots: torch.Tensor, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's write slots and context slots translated into the sliding-window pool
        (``full_to_swa``), once per step for every sliding layer of that window."""
        key = f"paged_attention_swa_w{window}"
        meta = ctx.scratch.get(key)
        if meta is None:
            table = ctx.kv.swa.full_to_swa
            loc = table.index_select(0, ctx.out_cache_loc.reshape(-1))
            meta = (loc.view(ctx.out_cache_loc.shape), table.index_select(0, slots))
            ctx.scratch[key] = meta
        return meta

    def _decode(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """One query per row: ``q [B,1,Hq,D]``, ``keys``/``values [B,L,Hkv,D]``."""
        b, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        f32 = torch.float32
        if torch.compiler.is_compiling():
            # Two multiply-reduces over the gathered rows as they lie in the pool ([L, Hkv, D]):
            # inductor fuses each gather into its reduction. The matmul form below makes it
            # materialise K transposed, an element-wise gather ~3x slower than the attention.
            # (Eager would materialise the products instead: it keeps the matmuls.)
            length = keys.shape[1]
            q32 = q.reshape(b, 1, hkv, group, d).to(f32)
            scores = (q32 * keys.view(b, length, hkv, 1, d).to(f32)).sum(-1) * self.scale
            probs = torch.softmax(scores + bias.view(b, length, 1, 1), dim=1)  # [B,L,Hkv,G]
            out = (probs.unsqueeze(-1) * values.view(b, length, hkv, 1, d).to(f32)).sum(1)
            return out.to(q.dtype).reshape(b, 1, self.num_heads * d)
        if keys.device.type == "cpu":
            return self._decode_per_kv_head(q, keys, values, bias)
        k32 = keys.transpose(1, 2).to(f32, memory_format=torch.contiguous_format)  # [B,Hkv,L,D]
        v32 = values.transpose(1, 2).to(f32, memory_format=torch.contiguous_format)
        q32 = q.reshape(b, hkv, group, d).to(f32)  # query head h reads kv head h // group
        scores = torch.matmul(q32, k32.transpose(-1, -2)).mul_(self.scale).add_(bias)
        probs = torch.softmax(scores, dim=-1)  # [B,Hkv,G,L]
        out = torch.matmul(probs, v32).to(q.dtype)  # [B,Hkv,G,D]
        return out.reshape(b, 1, self.num_heads * d)

    def _decode_per_kv_head(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Eager CPU decode: one batched matmul pair per kv head, on ``[B,L,D]`` views of the
        gathered rows (a strided operand BLAS reads in place), so K and V are never copied into
        head-major order. That copy was a third of an eager SmolLM2 step at batch 16."""
        b, length = keys.shape[:2]
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        f32 = torch.float32
        keys, values = keys.to(f32), values.to(f32)
        q32 = q.reshape(b, hkv, group, d).to(f32)
        # bmm reads each head's [B,L,D] view in place; baddbmm / out= into a strided slice
        # fall back to one small GEMM per row (measured 1.8x slower).
        scores = torch.stack(
            [torch.bmm(q32[:, h], keys[:, :, h].transpose(1, 2)) for h in range(hkv)], 1
        )
        probs = torch.softmax(scores.mul_(self.scale).add_(bias.view(b, 1, 1, length)), dim=-1)
        out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(hkv)], 1)
        return out.to(q.dtype).reshape(b, 1, self.num_heads * d)
