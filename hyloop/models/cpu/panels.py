"""Weights packed as panels for hyloop's CPU GEMMs (``panels.h`` gives the layouts).

A ``Panels`` is one Linear's weight in the layout hyloop's kernels read: float32, bfloat16,
int4 groups (a scale and a minimum per group of 32, fp16 when every one is exact in fp16) or
int8 groups (a scale per group of 32). ``split`` interleaves the two halves of a fused gate/up
projection, panel by panel, so that one thread's pair of panels holds a gate tile and its up
tile (``DecoderStack``); ``linear`` returns the columns in the weight's own order either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # (quant's layers import this module)
    from hyloop.models.quant.formats import Int4Groups, Int8Rows

F32, BF16, I4, I8 = 0, 1, 2, 3  # panels.h's Kind
GROUP = 32  # panels.h's kGroup: the integer kinds' group along K


@dataclass(frozen=True)
class Panels:
    data: torch.Tensor  # uint8, the packed panels
    kind: int
    n: int
    k: int
    split: int = 0
    half: bool = False

    @classmethod
    def dense(cls, weight: torch.Tensor, split: int = 0) -> Panels:
        """A float32 or bfloat16 weight ``[N, K]``, in its own dtype."""
        data = torch.ops.hyloop.pack_panels(weight.detach(), split)
        kind = F32 if weight.dtype == torch.float32 else BF16
        return cls(data, kind, weight.shape[0], weight.shape[1], split)

    @classmethod
    def int4(cls, groups: Int4Groups, split: int = 0) -> Panels:
        """Int4 groups of 32 (``code * scale + min``), the file's codes as they are."""
        if groups.group != GROUP:
            raise ValueError(f"int4 panels take groups of {GROUP}, not {groups.group}")
        scale, mins = groups.scale.float(), groups.min.float()
        half = _exact_in_fp16(scale) and _exact_in_fp16(mins)
        data = torch.ops.hyloop.pack_panels_i4(groups.codes, scale, mins, split, half)
        return cls(data, I4, groups.codes.shape[0], groups.codes.shape[1], split, half)

    @classmethod
    def int8(cls, rows: Int8Rows, split: int = 0) -> Panels:
        """Symmetric int8 codes with a scale per group of 32 (a row's one scale repeated)."""
        n, k = rows.codes.shape
        if k % GROUP:
            raise ValueError(f"int8 panels need whole groups of {GROUP} columns, not {k}")
        scale = rows.group_scales()
        return cls(torch.ops.hyloop.pack_panels_i8(rows.codes, scale, split), I8, n, k, split)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` in ``x``'s dtype (float32 or bfloat16 rows)."""
        return torch.ops.hyloop.panel_linear(
            x, self.data, self.kind, self.n, self.k, self.split, self.half, bias
        )

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _exact_in_fp16(t: torch.Tensor) -> bool:
    h = t.half()
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t)


def gate_up_split(name: str, out_features: int) -> int:
    """The ``split`` a Linear named ``name`` packs with: half its rows for a fused gate/up."""
    return out_features // 2 if name.rpartition(".")[2] == "gate_up_proj" else 0


def drop_buffers(module: nn.Module, names: tuple[str, ...]) -> int:
    """Free ``module``'s buffers ``names`` (each reads as None afterwards: a weight copy its chosen
    kernels no longer need: the reference codes once panels exist); returns the bytes freed."""
    freed = 0
    for name in names:
        buf = module._buffers[name]
        assert buf is not None, f"{name} was already dropped"
        freed += buf.numel() * buf.element_size()
        module._buffers[name] = None
    return freed
