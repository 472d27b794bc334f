"""Linear layers over weight-only int4 / int8 weights, each run by one of two kernels.

- ``Int4Linear``: ``aten._weight_int4pack_mm_for_cpu`` over a weight packed once by
  ``aten._convert_weight_to_int4pack_for_cpu`` (groups of 32 along the input, a scale and a zero
  per group), or hyloop's ``hyloop::panel_linear`` over the same codes as int4 panels
  (``models/cpu/panels.h``: vpdpbusd on 8-bit activations per group of 32);
- ``Int8Linear``: ``aten._weight_int8pack_mm`` (int8 codes, one scale per output channel), or
  ``hyloop::panel_linear`` over the same codes as int8 panels.

torch's two kernels are vectorised (AVX2 / AVX-512 on x86, NEON on Arm) for bfloat16
activations only (float32 ones take a scalar loop several times slower than a dense float32
GEMM), so on that path activations enter in bfloat16 and the output returns in the model's
dtype, with float32 accumulation. hyloop's quantize the activations to int8 per group of 32
and take the codes' dot products in integers. Which one a layer runs is measured on this
machine (``models/cpu/kernel_choice.calibrate_quantized``, kernels ``aten`` and ``tiled``), as
for dense Linears; without the CPU kernels it is torch's (their panels are made by
``attach_panels`` once the kernels are loaded). All are plain operators with fake kernels, so a
compiled step traces them as they are (extern calls).
"""

from __future__ import annotations

import platform
from abc import ABC, abstractmethod

import torch
from torch import nn

from hyloop.models.cpu.panels import Panels, drop_buffers
from hyloop.models.quant.formats import INT4_GROUP, Int4Groups, Int8Rows

ACT_DTYPE = torch.bfloat16  # the dtype both kernels have vectorised paths for


def kernels_available(device: torch.device) -> bool:
    """Whether the weight-only kernels here are the vectorised ones (CPU with AVX2 or better, or
    Arm); elsewhere (CUDA, plain x86-64) hyloop keeps the weights dense."""
    if device.type != "cpu":
        return False
    if platform.machine().lower() in ("arm64", "aarch64"):
        return True
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def int4_supported(out_features: int, in_features: int, group: int) -> bool:
    """The int4 kernel's shape rules: output rows a multiple of 16, whole groups."""
    return out_features % 16 == 0 and in_features % group == 0


def int8_supported(out_features: int, in_features: int) -> bool:
    """The int8 kernel's vector loop steps 8 (AVX2) to 16 (AVX-512) input columns at a time."""
    return in_features % 16 == 0


class WeightOnlyLinear(nn.Module, ABC):
    """What both layouts share: ``forward`` casts to the kernel's dtype and back, adds the bias."""

    def __init__(
        self, out_features: int, in_features: int, bias: torch.Tensor | None, split: int = 0
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.split = split  # a fused gate/up projection's panels interleave its halves
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernels: tuple[tuple[int, str], ...] = ()  # (rows, "aten" | "tiled"), ascending
        self.panels: Panels | None = None
        self.released: str | None = None  # the kernel whose copy ``release_unused`` dropped

    kind: str = ""  # "int4" | "int8": the kernel table's shape key prefix
    aten_buffer_names: tuple[str, ...] = ()  # the buffers torch's kernel reads

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` in ``ACT_DTYPE`` times the weight, ``[M, N]`` in ``ACT_DTYPE``."""

    @abstractmethod
    def make_panels(self) -> Panels | None:
        """The weight as panels (``attach_panels``), from the buffers that hold it; None where
        the panels cannot take its shape."""

    def aten_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers torch's kernel reads (``nbytes`` of a step on that path)."""
        return tuple(getattr(self, name) for name in self.aten_buffer_names)

    def attach_panels(self) -> None:
        """Pack the weight as panels for hyloop's kernels (once they are loaded): the ``tiled``
        kernel, and what a decoder stack reads."""
        if self.panels is None and (panels := self.make_panels()) is not None:
            self.register_buffer("panel_data", panels.data, persistent=False)
            self.panels = panels

    def tiled(self, x: torch.Tensor) -> torch.Tensor:
        """hyloop's kernel: ``x [M, K]`` (float32 or bfloat16) times the weight plus the bias,
        ``[M, N]`` in ``x``'s dtype."""
        p = self.panels
        if p is None:
            raise RuntimeError(f"{self.shape_key}: no panels (attach_panels first)")
        return torch.ops.hyloop.panel_linear(
            x, self.panel_data, p.kind, p.n, p.k, p.split, p.half, self.bias
        )

    def tiled_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers hyloop's kernel reads."""
        return () if self.panels is None else (self.panel_data,)

    def set_kernels(self, kernels: dict[int, str]) -> None:
        """One kernel for every row count: the two differ in their activations' rounding
        (bfloat16 against int8 per group), so a row's result must not depend on how many rows
        share its call (a batch, a prefill chunk, a prefix-cache hit shortening a prefill).
        ``kernels`` maps each measured row count to its choice; all must agree."""
        if len(set(kernels.values())) > 1:
            raise ValueError(f"{self.shape_key}: one kernel for every row count, not {kernels}")
        if self.released in kernels.values():
            raise ValueError(f"{self.shape_key}: the weight's {self.released} copy was released")
        self.kernels = tuple(sorted(kernels.items()))

    def kernel(self, rows: int) -> str:
        """The measured kernel (the same for every row count); unmeasured, torch's."""
        return self.kernels[0][1] if self.kernels else "aten"

    def release_unused(self, keep_panels: bool) -> int:
        """Once the kernel is chosen for good: drop the weight's copy only the other kernel reads
        (torch's packed codes and scales, or the panels unless ``keep_panels``: a decoder stack
        reads them), so the layer holds the file's bytes once; returns the bytes dropped. The
        choice is then fixed: ``set_kernels`` refuses the dropped kernel."""
        if not self.kernels or self.released is not None:
            return 0  # unmeasured: the choice could still change
        if self.kernel(1) == "tiled":
            names, self.released = self.aten_buffer_names, "aten"
        elif self.panels is not None and not keep_panels:
            names, self.released, self.panels = ("panel_data",), "tiled", None
        else:
            return 0
        return drop_buffers(self, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.kernel(x2.shape[0]) == "tiled":
            out = self.tiled(x2)
        else:
            out = self.matmul(x2.to(ACT_DTYPE)).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def shape_key(self) -> str:
        return f"{self.kind} {self.out_features}x{self.in_features}"

    @property
    def nbytes(self) -> int:
        """Bytes a one-row step reads for this layer's weight (codes and scales)."""
        bufs = self.tiled_buffers() if self.kernel(1) == "tiled" else self.aten_buffers()
        return sum(b.numel() * b.element_size() for b in bufs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(WeightOnlyLinear):
    kind = "int4"
    aten_buffer_names = ("packed", "scales_zeros")

    def __init__(
        self, groups: Int4Groups, bias: torch.Tensor | None = None, split: int = 0
    ) -> None:
        n, k = groups.codes.shape
        super().__init__(n, k, bias, split)
        self.group = groups.group
        if not int4_supported(n, k, self.group):
            raise ValueError(
                f"int4 weight [{n}, {k}] with groups of {self.group}: the kernel needs output "
                f"rows a multiple of 16 and input columns a multiple of the group"
            )
        codes = groups.codes.to(torch.int32).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # The kernel's convention: weight = (code - 8) * scale + zero, scales and zeros [K/g, N, 2].
        zero = groups.min + 8 * groups.scale
        sz = torch.stack([groups.scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", sz.to(ACT_DTYPE))
        # Kept for ``make_panels``, compactly: per group of 32, byte j holds code j (low
        # nibble) and code j + 16 (high); dropped once the panels are made.
        g = groups.codes.view(n, k // 32, 2, 16)
        self._source: tuple[torch.Tensor, ...] | None = (
            (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous(),
            groups.scale.float().contiguous(),
            groups.min.float().contiguous(),
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_zeros
        )

    def make_panels(self) -> Panels | None:
        assert self._source is not None
        nibbles, scale, mins = self._source
        n, half_k = nibbles.shape
        codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=2)  # [n, k / 32, 2, 16]
        codes = codes.view(n, half_k // 16, 16, 2).transpose(2, 3).reshape(n, 2 * half_k)
        panels = Panels.int4(Int4Groups(codes.contiguous(), scale, mins), self.split)
        self._source = None
        return panels

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


class Int8Linear(WeightOnlyLinear):
    kind = "int8"
    aten_buffer_names = ("codes", "scales")

    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None = None, split: int = 0) -> None:
        n, k = rows.codes.shape
        super().__init__(n, k, bias, split)
        if not int8_supported(n, k):
            raise ValueError(f"int8 weight [{n}, {k}]: the kernel needs input columns % 16 == 0")
        self.register_buffer("codes", rows.codes.contiguous())
        self.register_buffer("scales", rows.scale.to(ACT_DTYPE))
        self.register_buffer("scales_f32", rows.scale.float().contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    def make_panels(self) -> Panels | None:
        if self.in_features % INT4_GROUP:
            return None  # int8 panels hold whole groups of 32
        return Panels.int8(Int8Rows(self.codes, self.scales_f32), self.split)
