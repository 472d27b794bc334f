"""Linear layers over weight-only int4 / int8 weights, computing the quantized modes' numerics
(``quant.reference``: 16-bit activations per group of 32, integer dot products, one stated chain
of float32 roundings over the groups).

- ``Int4Linear``: 4-bit codes in groups of 32 along the input, a scale and a minimum per group
  (GGUF's Q4_0 / Q4_1 / Q4_K, kept as the file holds them);
- ``Int8Linear``: int8 codes with a scale per group of 32 (GGUF's Q8_0 blocks as the file holds
  them) or per output row (requantized from any other type).

Each runs as hyloop's ``hyloop::panel_linear`` over the weight packed as panels once the CPU
kernels are loaded (``attach_panels``; the decoder stack reads the same panels), and otherwise
as ``reference.quant_linear`` in torch ops over the codes. Both compute the same bits for every
row count, so a row's result never depends on how many rows share its call, which kernels this
machine has built, or a timing. Once the panels exist the codes the reference reads are dropped,
so a layer holds its weight once. Both are plain operators to a compiled step (extern calls).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from hyloop.models.cpu.panels import Panels, drop_buffers
from hyloop.models.quant.formats import INT4_GROUP, Int4Groups, Int8Rows
from hyloop.models.quant.reference import quant_linear


def kernels_available(device: torch.device) -> bool:
    """Whether the quantized modes run on ``device``: every CPU (hyloop's panels where built, the
    torch reference elsewhere); on other devices hyloop keeps the weights dense."""
    return device.type == "cpu"


def int4_supported(out_features: int, in_features: int, group: int) -> bool:
    """The int4 layout's shape rules: output rows a multiple of 16, whole groups of 32."""
    return out_features % 16 == 0 and group == INT4_GROUP and in_features % group == 0


def int8_supported(out_features: int, in_features: int) -> bool:
    """Activations are quantized per group of 32 input columns."""
    return in_features % INT4_GROUP == 0


class WeightOnlyLinear(nn.Module, ABC):
    """What both layouts share: the reference's buffers until the panels replace them."""

    kind: str = ""  # "int4" | "int8": the summary's shape key prefix
    reference_buffers: tuple[str, ...] = ()  # what ``quant_linear`` reads (dropped with panels)

    def __init__(
        self, out_features: int, in_features: int, bias: torch.Tensor | None, split: int = 0
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.split = split  # a fused gate/up projection's panels interleave its halves
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.panels: Panels | None = None

    @abstractmethod
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` times the weight plus the bias in torch ops (``quant_linear``)."""

    @abstractmethod
    def make_panels(self) -> Panels:
        """The weight as panels, from the reference's buffers."""

    def attach_panels(self) -> None:
        """Pack the weight as panels for hyloop's kernels (once they are loaded) and drop the
        reference's copy: from here on the layer runs ``hyloop::panel_linear``."""
        if self.panels is None:
            panels = self.make_panels()
            self.register_buffer("panel_data", panels.data, persistent=False)
            self.panels = panels
            drop_buffers(self, self.reference_buffers)

    @property
    def kernel(self) -> str:
        """``panels`` (hyloop's kernel) or ``reference`` (torch ops): the same numbers."""
        return "panels" if self.panels is not None else "reference"

    @property
    def skips_rows(self) -> bool:
        """Whether ``forward``'s ``live`` leaves rows out (on the panels)."""
        return self.panels is not None

    def forward(self, x: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        p = self.panels
        if p is not None:
            args = (x2, self.panel_data, p.kind, p.n, p.k, p.split, p.half, self.bias)
            if live is None:
                out = torch.ops.hyloop.panel_linear(*args)
            else:
                out = torch.ops.hyloop.panel_linear_live(*args, live)
        else:
            out = self.reference(x2)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def shape_key(self) -> str:
        return f"{self.kind} {self.out_features}x{self.in_features}"

    @property
    def nbytes(self) -> int:
        """Bytes a one-row step reads for this layer's weight (codes and scales)."""
        names = ("panel_data",) if self.panels is not None else self.reference_buffers
        return sum(
            b.numel() * b.element_size() for n in names if (b := getattr(self, n)) is not None
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(WeightOnlyLinear):
    kind = "int4"
    reference_buffers = ("nibbles", "scale", "mins")

    def __init__(
        self, groups: Int4Groups, bias: torch.Tensor | None = None, split: int = 0
    ) -> None:
        n, k = groups.codes.shape
        super().__init__(n, k, bias, split)
        self.group = groups.group
        if not int4_supported(n, k, self.group):
            raise ValueError(
                f"int4 weight [{n}, {k}] with groups of {self.group}: the kernel needs output "
                f"rows a multiple of 16 and input columns in groups of {INT4_GROUP}"
            )
        # Compactly: byte j of a row holds code 2j (low nibble) and code 2j + 1 (high).
        c = groups.codes.view(n, k // 2, 2)
        self.register_buffer("nibbles", (c[..., 0] | (c[..., 1] << 4)).contiguous())
        self.register_buffer("scale", groups.scale.float().contiguous())
        self.register_buffer("mins", groups.min.float().contiguous())

    def codes(self) -> torch.Tensor:
        """The weight's codes, uint8 ``[N, K]`` in [0, 15]."""
        nib = self.nibbles
        return torch.stack([nib & 0x0F, nib >> 4], dim=-1).view(self.out_features, -1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.codes(), self.scale, self.mins, self.bias)

    def make_panels(self) -> Panels:
        return Panels.int4(Int4Groups(self.codes().contiguous(), self.scale, self.mins), self.split)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


class Int8Linear(WeightOnlyLinear):
    kind = "int8"
    reference_buffers = ("codes", "scale")

    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None = None, split: int = 0) -> None:
        n, k = rows.codes.shape
        super().__init__(n, k, bias, split)
        if not int8_supported(n, k):
            raise ValueError(
                f"int8 weight [{n}, {k}]: activations are quantized per group of "
                f"{INT4_GROUP} input columns, so they must be a multiple of {INT4_GROUP}"
            )
        self.register_buffer("codes", rows.codes.contiguous())
        self.register_buffer("scale", rows.group_scales().contiguous())  # [N, K / 32]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.codes, self.scale, None, self.bias)

    def make_panels(self) -> Panels:
        return Panels.int8(Int8Rows(self.codes, self.scale), self.split)
