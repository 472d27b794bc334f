"""Weight-only quantized formats, as the kernels read them.

- ``Int4Groups``: per output row, groups of ``group`` input columns; a weight is
  ``code * scale + min`` with a code in [0, 15] (GGUF's Q4_0, Q4_1 and Q4_K are exactly this with
  groups of 32, so they convert without loss).
- ``Int8Rows``: per output row (or per group of 32 along it) one scale; a weight is
  ``code * scale`` with an int8 code (symmetric per-channel int8, or GGUF's Q8_0 blocks).

Both come either from a GGUF file's own blocks (``loaders.gguf_blocks``) or from a dense weight by
round-to-nearest (``int4_from_dense``, ``int8_from_dense``). Scales are rounded to the kernels'
activation dtype *before* the codes are chosen, so the codes are the best ones for the scale the
kernel will actually multiply by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32  # GGUF's 4-bit block (and Q4_K's sub-block) size; the finest group the kernel takes


@dataclass(frozen=True)
class Int4Groups:
    """``codes`` uint8 ``[N, K]`` in [0, 15]; ``scale`` and ``min`` float32 ``[N, K // group]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.codes.float().view(n, k // self.group, self.group)
        return (g * self.scale[..., None] + self.min[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Row blocks stacked (a fused q/k/v or gate/up projection)."""
        return Int4Groups(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.min for p in parts]),
        )


@dataclass(frozen=True)
class Int8Rows:
    """``codes`` int8 ``[N, K]``; ``scale`` float32 ``[N]`` (one per row: symmetric
    per-channel int8) or ``[N, K / 32]`` (one per group of 32: GGUF's Q8_0 blocks as the file
    holds them)."""

    codes: torch.Tensor
    scale: torch.Tensor

    def group_scales(self) -> torch.Tensor:
        """The scale of every group of 32, ``[N, K / 32]``."""
        n, k = self.codes.shape
        if self.scale.dim() == 2:
            return self.scale.float()
        return self.scale.float().view(n, 1).expand(n, k // INT4_GROUP).contiguous()

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.codes.float().view(n, -1, INT4_GROUP) * self.group_scales()[..., None]
        return g.view(n, k)

    @staticmethod
    def cat(parts: list[Int8Rows]) -> Int8Rows:
        """Row blocks stacked (a fused projection), with a scale per group of 32."""
        return Int8Rows(
            torch.cat([p.codes for p in parts]), torch.cat([p.group_scales() for p in parts])
        )


def int4_from_dense(
    weight: torch.Tensor, group: int = INT4_GROUP, scale_dtype: torch.dtype = torch.bfloat16
) -> Int4Groups:
    """Asymmetric round-to-nearest 4-bit groups (each group's min and max kept, as Q4_1 does)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4: {k} input columns are not a multiple of the group {group}")
    w = weight.detach().float().view(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(scale_dtype).float()
    # The kernel adds ``zero - 8 * scale``, ``zero`` rounded to ``scale_dtype``: take that min.
    low = (lo + 8 * scale).to(scale_dtype).float() - 8 * scale
    codes = ((w - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Groups(codes.view(n, k), scale, low)


def int8_from_dense(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> Int8Rows:
    """Symmetric per-output-channel round-to-nearest int8."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(scale_dtype).float()
    codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Rows(codes, scale)
