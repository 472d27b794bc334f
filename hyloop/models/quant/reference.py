"""The quantized modes' numerics, in torch: the definition every kernel serving them matches.

A weight-only int4 / int8 Linear computes ``x @ W.T`` with 16-bit integer activations:

1. each row of ``x`` (float32, or bfloat16 widened exactly) is cut into groups of 32; a group's
   scale is ``d = max|v| / 32512`` (0 for an all-zero group; 32512 = 127 * 256, so the kernels
   hold a code as two int8 halves), its codes ``round(v * (1 / d))`` (half to even), and its sum
   as the codes hold it, ``fsum = d * (c_0 + ... + c_31)`` (the integer sum exact, one rounding);
2. per output column and group, the integer dot product of the activation codes with the weight
   codes (exact in int32), converted to float32 once, to nearest even (exact for int4 codes:
   below 2**24);
3. the output is a chain over the groups in order of fused multiply-adds in float32 (one
   rounding each): ``acc = fma(dot, scale * d, acc)`` (``scale * d`` rounded once), then for int4
   ``acc = fma(min, fsum, acc)``; plus the bias, then the input's dtype.

Why 16 bits: with 8-bit codes (llama.cpp's Q8 path) the activations' rounding is redrawn by any
change upstream, however small, and that noise alone moved SmolLM2's first-token distribution
by a KL of about 0.004: as much as position-independent reuse's own approximation. At 16 bits
it is gone, for the same weight bytes; the integer work per weight doubles.

The minimum term reads the quantized activations, as the codes term does: the layer then computes
the dequantized weight times the quantized activations, whose rounding error meets the centred
weight ``scale * code + min``. A minimum term over the exact activations would leave the error
on the codes alone (0..15, never centred): 1.3-3.5x the layer error and about five times the
first-token KL against dequantized weights on SmolLM2.

``hyloop::panel_linear`` and the decoder stack compute exactly this (``models/cpu/panels.h``);
``quant_linear`` is the same in torch ops, for machines where those kernels are not built (no
C++ compiler, ``HYLOOP_CPU_OPS=0``). It is an opaque operator to a compiled step, so inductor
never reorders its chain.
"""

from __future__ import annotations

import torch

GROUP = 32
CODE_MAX = 32512.0  # panels.h's kCodeMax
INT4, INT8 = 2, 3  # panels.h's kinds


def quantize_activations(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (codes float32 ``[M, G, 32]`` holding integers, scale ``[M, G]``,
    the sum the codes hold ``[M, G]``), as step 1 defines them."""
    m, k = x.shape
    v = x.float().reshape(m, k // GROUP, GROUP)
    d = v.abs().amax(-1) / CODE_MAX
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(v * inv[..., None])
    return codes, d, d * codes.sum(-1)  # the code sum is an exact integer below 2**24


def _group_dots(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """``[M, G, 32]`` x ``[N, G, 32]`` -> ``[G, M, N]`` integer dots, exact in float64 (every
    partial sum is an integer below 2**53, so no order rounds), then to float32 once."""
    q, w = codes.double().transpose(0, 1), weight_codes.double().permute(1, 2, 0)
    return torch.bmm(q, w).float()


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32, as the CPU's fused multiply-add, for float32
    operands whose product is exact in float64 (24 + 24 significant bits): the float64 sum is
    rounded to odd (its TwoSum error says whether it was exact, and which way it moved), and a
    float64 rounded to odd then rounded to float32 is the correctly rounded sum (53 >= 24 + 2
    bits; Boldo and Melquiond)."""
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    back = s - p
    err = (p - (s - back)) + (c64 - back)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


@torch.library.custom_op("hyloop::quant_linear", mutates_args=())
def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x [.., K]`` times a weight-only weight as the module docstring defines it: ``codes
    [N, K]`` (uint8 in [0, 15] with ``mins``: int4; int8 in [-127, 127] without), ``scale`` (and
    ``mins``) float32 ``[N, K / 32]``; ``[.., N]`` in ``x``'s dtype."""
    n, k = codes.shape
    x2 = x.reshape(-1, k)
    q, d, fsum = quantize_activations(x2)
    dots = _group_dots(q, codes.view(n, k // GROUP, GROUP))
    acc = torch.zeros(x2.shape[0], n, dtype=torch.float32)
    for g in range(k // GROUP):
        acc = fma(dots[g], scale[:, g][None, :] * d[:, g][:, None], acc)
        if mins is not None:
            acc = fma(mins[:, g][None, :], fsum[:, g][:, None], acc)
    if bias is not None:
        acc += bias.float()
    return acc.to(x.dtype).view(*x.shape[:-1], n)


@quant_linear.register_fake
def _(x: torch.Tensor, codes: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0]))
