"""hyloop's CPU numerics in torch ops: the definitions its C++ kernels compute, bit for bit.

On CPU a model's tokens must not depend on whether hyloop's kernels are built (a first run, a
machine without a compiler, ``HYLOOP_CPU_OPS=0``), so every operator whose rounding the kernels
own is defined once, here, in torch ops that round exactly where the kernels do (``attend.h``,
``panels.h``), and the torch fallbacks run these definitions:

- ``exp``: ``n = round(x * log2 e)`` (half to even), ``r = (x - n * C1) - n * C2``, a degree-6
  polynomial by Horner with every multiply and add rounded on its own, then ``p * 2^n`` rounded
  once; below ``EXP_LO`` it is 0.
- ``silu``: ``x / (1 + exp(0 - x))``.
- ``lane_sum``: 16 lanes, lane ``l`` the sum from +0, in order, of elements ``l, l + 16, ...``,
  then the tree ``(l, l + 8)``, ``(l, l + 4)``, ``(l, l + 2)``, ``(0, 1)``. It is the sum of
  squares of ``rms_norm`` and the query-key dot product of ``attention``.
- ``rms_norm``: ``x * (1 / sqrt(lane_sum(x * x) / n + eps))``, rounded to the model's dtype, times
  the weight.
- ``attention``: ``hyloop::decode_attention``'s contract: scores ``lane_sum(q * k) * scale +
  bias`` over the visible columns, ``exp(score - max)``, their sum from +0 column by column, the
  output the column-by-column sum from +0 of ``p * v``, times ``1 / sum``.
- ``dense_linear``: the panel GEMMs' chain: each output the sum from +0 over k in order of
  ``x[k] * w[k]``, one fused multiply-add a step for float32 weights; for bfloat16 weights the
  products are exact in float32, so each step is one rounded add, the pairs ``(2i, 2i + 1)`` in
  the order ``vdpbf16ps`` adds them; then the bias.

A sum in order is ``numpy.add.accumulate`` (one float32 add after another, no reassociation);
torch's own reductions, and its ``cumsum`` (which accumulates float32 in float64), have orders of
their own; a square root is numpy's (torch's vectorised ``sqrt`` is not correctly rounded in
every lane). These run slower than the kernels, never differently.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hyloop.models.quant.reference import fma

F32 = torch.float32
LANES = 16
BLOCK_ELEMENTS = 1 << 22  # the most float32 values one block of products holds
# float32 constants, exactly as attend.h spells them.
LOG2E = float.fromhex("0x1.715476p+0")
C1 = float.fromhex("0x1.63p-1")
C2 = float.fromhex("-0x1.bd0106p-13")
EXP_LO = float.fromhex("-0x1.5d589ep+6")
EXP_HI = float.fromhex("0x1.61814ap+6")
POLY = tuple(
    float.fromhex(h) for h in ("0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5", "0x1.555556p-3")
) + (0.5, 1.0, 1.0)
# The order vdpbf16ps adds a pair's two products in (the odd k, then the even: Intel's
# pseudocode), and so panels.h's portable bfloat16 chain.
BF16_PAIR_ORDER = (1, 0)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e^x`` of a float32 tensor as ``attend.h``'s ``exp16`` computes it."""
    under = x < EXP_LO
    x = x.clamp(EXP_LO, EXP_HI)
    n = torch.round(x * LOG2E)
    r = x - n * C1
    r = r - n * C2
    p = torch.full_like(x, POLY[0])
    for c in POLY[1:]:
        p = p * r + c
    # p * 2^n, rounded once: the power of two exactly in float64, the product exact there.
    scale = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)
    out = (p.double() * scale).to(F32)
    return out.masked_fill(under, 0.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU in float32 (``attend.h``'s ``silu``), in ``x``'s dtype."""
    v = x.to(F32)
    return (v / (1.0 + exp(0.0 - v))).to(x.dtype)


def sum_in_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The float32 sum along ``dim`` from +0, one element after another."""
    a = t.to(F32).movedim(dim, 0).contiguous().numpy()
    zero = np.zeros((1, *a.shape[1:]), dtype=np.float32)
    total = np.add.accumulate(np.concatenate([zero, a]), axis=0)[-1]
    return torch.from_numpy(np.ascontiguousarray(total))


def tree16(a: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` -> ``[...]`` by the fixed tree."""
    a = a[..., :8] + a[..., 8:]
    a = a[..., :4] + a[..., 4:]
    a = a[..., :2] + a[..., 2:]
    return a[..., 0] + a[..., 1]


def lane_sum(t: torch.Tensor) -> torch.Tensor:
    """The lane sum of ``t [..., n]`` (float32) over its last dim."""
    pad = -t.shape[-1] % LANES
    if pad:
        t = F.pad(t, (0, pad))
    chunks = t.reshape(*t.shape[:-1], -1, LANES)
    return tree16(sum_in_order(chunks, -2))


def rms_statistic(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean square + eps)`` of float32 rows ``h [..., n]``, ``[..., 1]``."""
    ms = lane_sum(h * h) / float(h.shape[-1])
    return torch.reciprocal(sqrt(ms + torch.tensor(eps, dtype=F32))).unsqueeze(-1)


def sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root (numpy's is the CPU's instruction; torch's vectorised
    one is off by an ulp in some lanes)."""
    return torch.from_numpy(np.sqrt(t.contiguous().numpy()))


def attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``hyloop::decode_attention``: ``q [B, Hq, D]`` over pool rows ``k_buf / v_buf [S, Hkv,
    D]`` at ``slots [B, L]``, visible where ``bias [B, L]`` is not -inf -> ``[B, Hq, D]``."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    hq, d = q.shape[1:]
    hkv = k_buf.shape[1]
    block = max(1, BLOCK_ELEMENTS // max(1, slots.shape[1] * hq * d))
    for b0 in range(0, q.shape[0], block):  # rows a block at a time: bounded scratch
        rows = slice(b0, min(q.shape[0], b0 + block))
        b = rows.stop - rows.start
        keys = k_buf[slots[rows]].to(F32)  # [b, L, Hkv, D]
        values = v_buf[slots[rows]].to(F32)
        qf = q[rows].to(F32).view(b, 1, hkv, hq // hkv, d)
        s = lane_sum(qf * keys.unsqueeze(3))  # [b, L, Hkv, G]
        visible_bias = bias[rows].to(F32).view(b, -1, 1, 1)
        scores = s * torch.tensor(scale, dtype=F32) + visible_bias
        visible = visible_bias != -torch.inf
        mx = scores.masked_fill(~visible, -torch.inf).amax(1, keepdim=True)
        p = exp(scores - mx).masked_fill(~visible, 0.0)
        inv = torch.reciprocal(sum_in_order(p, 1))  # [b, Hkv, G]
        pv = (p.unsqueeze(-1) * values.unsqueeze(3)).masked_fill(~visible.unsqueeze(-1), 0.0)
        o = sum_in_order(pv, 1)  # [b, Hkv, G, D]
        out[rows] = (o * inv.unsqueeze(-1)).reshape(b, hq, d).to(q.dtype)
    return out


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [.., K] @ weight.T (+ bias)`` in ``x``'s dtype as hyloop's panels compute it for a
    float32 or bfloat16 ``weight [N, K]`` (the input rows taken in the weight's dtype)."""
    n, k = weight.shape
    rows = x.reshape(-1, k).to(weight.dtype)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=F32)
    chain = _bf16_chain if weight.dtype == torch.bfloat16 else _f32_chain
    row_block = max(1, min(m, BLOCK_ELEMENTS // (k * LANES)))
    col_block = max(LANES, BLOCK_ELEMENTS // (k * row_block))
    for r0 in range(0, m, row_block):
        for c0 in range(0, n, col_block):
            w = weight[c0 : c0 + col_block]
            out[r0 : r0 + row_block, c0 : c0 + w.shape[0]] = chain(rows[r0 : r0 + row_block], w)
    if bias is not None:
        out = out + bias.to(F32)
    return out.to(x.dtype).view(*x.shape[:-1], n)


def _bf16_chain(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = w.shape[1]
    xf, wf = _flush_subnormal(rows.to(F32)), _flush_subnormal(w.to(F32))
    if k % 2:
        xf, wf = F.pad(xf, (0, 1)), F.pad(wf, (0, 1))
    products = xf.unsqueeze(1) * wf.unsqueeze(0)  # [M, N, K], exact in float32
    pairs = products.view(*products.shape[:2], -1, 2)[..., list(BF16_PAIR_ORDER)]
    return sum_in_order(pairs.reshape(*products.shape[:2], -1), -1)


def _f32_chain(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(rows.shape[0], w.shape[0], dtype=F32)
    for i in range(w.shape[1]):
        acc = fma(rows[:, i : i + 1], w[:, i].unsqueeze(0), acc)
    return acc


def _flush_subnormal(t: torch.Tensor) -> torch.Tensor:
    """vdpbf16ps reads subnormal inputs as zero."""
    return t.masked_fill(t.abs() < torch.finfo(F32).tiny, 0.0)


# Opaque operators for a compiled step (inductor would fuse, and so reorder, the torch ops
# above): each runs its definition as it stands.


# ``hyloop::silu``: this definition, or the C++ kernel (``cpu_ops.cpp``) where it is loaded.
_LIB = torch.library.Library("hyloop", "FRAGMENT")
_LIB.define("silu(Tensor x) -> Tensor")
_LIB.impl("silu", silu, "CompositeExplicitAutograd")


def contiguous_like(x: torch.Tensor, *_: object) -> torch.Tensor:
    """The fake (meta) kernel of an op whose output is its first input's shape and dtype."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


torch.library.register_fake("hyloop::silu", contiguous_like, lib=_LIB)


@torch.library.custom_op("hyloop::attention_reference", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``attention``: ``hyloop::decode_attention`` where the CPU kernels are not loaded."""
    return attention(q, k_buf, v_buf, slots, bias, scale)


attention_op.register_fake(contiguous_like)


@torch.library.custom_op("hyloop::dense_reference", mutates_args=())
def dense_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``dense_linear``: a panel Linear where the CPU kernels are not loaded."""
    return dense_linear(x, weight, bias)


@dense_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``hyloop::topk_rows``: the ``k`` largest per row, descending, ties to the lower index."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[:, :k].contiguous(), indices[:, :k].contiguous()
