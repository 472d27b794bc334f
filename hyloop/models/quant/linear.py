"""Linear layers over weight-only int4 / int8 weights, run by torch's own CPU kernels.

- ``Int4Linear``: ``aten._weight_int4pack_mm_for_cpu`` over a weight packed once by
  ``aten._convert_weight_to_int4pack_for_cpu`` (groups of 32 along the input, a scale and a zero
  per group);
- ``Int8Linear``: ``aten._weight_int8pack_mm`` (int8 codes, one scale per output channel).

Both kernels are vectorised (AVX2 / AVX-512 on x86, NEON on Arm) for bfloat16 activations only;
float32 ones take a scalar loop several times slower than a dense float32 GEMM. So activations
enter in bfloat16 and the output returns in the model's dtype: a float32 model computes its
weight-only layers with bfloat16 inputs and outputs (the accumulation stays float32), which
``bench/quantized.py`` measures against the dequantized model. Both ops are plain ATen ops with
fake kernels, so a compiled step traces them as they are (extern calls inside the graph).
"""

from __future__ import annotations

import platform
from abc import ABC, abstractmethod

import torch
from torch import nn

from hyloop.models.quant.formats import Int4Groups, Int8Rows

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

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` in ``ACT_DTYPE`` times the weight, ``[M, N]`` in ``ACT_DTYPE``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features).to(ACT_DTYPE)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes a step reads for this layer's weight (codes and scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(WeightOnlyLinear):
    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None) -> None:
        n, k = groups.codes.shape
        super().__init__(n, k, bias)
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

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_zeros
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


class Int8Linear(WeightOnlyLinear):
    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None = None) -> None:
        n, k = rows.codes.shape
        super().__init__(n, k, bias)
        if not int8_supported(n, k):
            raise ValueError(f"int8 weight [{n}, {k}]: the kernel needs input columns % 16 == 0")
        self.register_buffer("codes", rows.codes.contiguous())
        self.register_buffer("scales", rows.scale.to(ACT_DTYPE))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
