"""SwiGLU MLP with the gate and up projections fused into one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyloop.models.cpu import numerics  # noqa: F401  (defines hyloop::silu)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``gate_up_proj`` holds ``[gate; up]`` stacked on rows."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        # CPU: the SiLU the decoder stack's C++ computes (``models.cpu.numerics``).
        act = torch.ops.hyloop.silu(gate) if gate.device.type == "cpu" else F.silu(gate)
        return self.down_proj(act * up)
