"""hyloop's CPU compute: packed oneDNN Linears with per-machine kernel choices
(``packed_linear``, ``kernel_choice``) and the C++ kernels (``cpu_ops``), set up once per model
by ``CpuKernels``."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.kernel_choice import calibrate, shape_key
from hyloop.models.cpu.packed_linear import PackedLinear, pack_linears, packing_available


class CpuKernels:
    """A model's CPU kernels: its Linears packed (and their GEMM kernels measured on this
    machine, ``measure``), and the C++ kernels loaded when ``native`` allows (``auto``: when
    already built; otherwise built after this process exits, for later runs)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        pack: bool,
        measure: bool,
        rows: list[int],
        compiled: bool,
        native: Literal["auto"] | bool,
    ) -> None:
        self.layers: list[PackedLinear] = []
        self.table: Any = None
        if pack and packing_available(torch.device("cpu")):
            pack_linears(model)
            self.layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
            if measure:
                # An eager step cannot use the GEMV; ``calibrate_gemv`` times it when a one-row
                # step is about to be compiled.
                self.table = calibrate(self.layers, [1, *rows], with_gemv=compiled)
        self.native = native is not False and cpu_ops.ensure_loaded(build=native is True)
        if self.native:
            cpu_ops.register_packed(model)

    @property
    def measured(self) -> bool:
        return self.table is not None

    def calibrate_gemv(self) -> None:
        """Before a one-row step is compiled: time the compiled GEMV for one row too."""
        if self.measured:
            calibrate(self.layers, [1], with_gemv=True)

    def summary(self) -> dict[str, Any] | None:
        """What was measured and chosen (the run summary's ``cpu kernels`` lines)."""
        if self.table is None:
            return None
        chosen = {shape_key(m.weight): dict(m.kernels) for m in self.layers}
        return {
            "measured": self.table.measured,
            "measure_s": round(self.table.measure_s, 2),
            "choices": chosen,
        }


__all__ = ["CpuKernels", "cpu_ops"]
