"""RMSNorm, plain (Llama) and zero-centred ``(1 + w)`` (Qwen3-Next / Qwen3.5)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``w * x / rms(x)``, normalised in fp32 as HF does: a plain ``w`` scales after the cast
    back, a zero-centred ``1 + w`` (``zero_centered=True``) before it."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
