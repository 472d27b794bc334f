"""RMSNorm, plain (Llama) and zero-centred ``(1 + w)`` (Qwen3-Next / Qwen3.5).

The norm is one operator, ``hyloop::rms_norm``, whose kernel is the eager torch code below: a
compiled step calls it as it is instead of fusing its own version, whose reduction order and
dropped bfloat16 roundings would give a compiled step other bits than an eager one (and so,
where activations are quantized to 8 bits, other tokens). On CPU its statistic is
``models.cpu.numerics``' (a sum of squares in a stated order), the one the decoder stack's C++
computes.
"""

from __future__ import annotations

import torch
from torch import nn

from hyloop.models.cpu import numerics

_LIB = torch.library.Library("hyloop", "FRAGMENT")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps, bool zero_centered) -> Tensor")


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    if h.device.type == "cpu":
        h = h * numerics.rms_statistic(h, eps)
    else:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


_LIB.impl("rms_norm", _rms_norm, "CompositeExplicitAutograd")


@torch.library.register_fake("hyloop::rms_norm", lib=_LIB)
def _rms_norm_fake(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    dtype = x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, normalised in fp32 as HF does: a plain ``w`` scales after the cast
    back, a zero-centred ``1 + w`` (``zero_centered=True``) before it."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hyloop.rms_norm(x, self.weight, self.eps, self.zero_centered)
