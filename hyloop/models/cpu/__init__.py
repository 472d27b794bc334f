"""hyloop's CPU compute: packed oneDNN Linears with per-machine kernel choices
(``packed_linear``, ``kernel_choice``) and the C++ kernels (``cpu_ops``), set up once per model
by ``CpuKernels``."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import nn

from hyloop import omp_policy
from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.decoder_stack import DecoderStack, stack_refusal
from hyloop.models.cpu.kernel_choice import calibrate, calibrate_quantized, shape_key
from hyloop.models.cpu.packed_linear import PackedLinear, pack_linears, packing_available
from hyloop.models.cpu.stack_choice import choose_stack_rows
from hyloop.models.quant.linear import WeightOnlyLinear

log = logging.getLogger(__name__)
_warned_policy = False


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
        stack: Literal["auto"] | bool = False,
    ) -> None:
        self.layers: list[PackedLinear] = []
        self.table: Any = None
        self.openmp = omp_policy.status()
        _warn_spinning_waits(self.openmp)
        # First: the loaded kernels add a GEMM candidate (``tiled``) to every Linear.
        self.native = native is not False and cpu_ops.ensure_loaded(build=native is True)
        if pack and (packing_available(torch.device("cpu")) or self.native):
            pack_linears(model, tiled=self.native)
            self.layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
            if measure:
                # An eager step cannot use the GEMV; ``calibrate_gemv`` times it when a one-row
                # step is about to be compiled.
                self.table = calibrate(
                    self.layers, [1, *rows], with_gemv=compiled, tiled=self.native
                )
        if self.native:
            cpu_ops.register_packed(model)
        self.quantized = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
        if self.native:
            for layer in self.quantized:
                layer.attach_panels()
        if self.native and measure and self.quantized:
            self.table = calibrate_quantized(self.quantized, [1, *rows], table=self.table)
        self.stack: DecoderStack | None = None
        why = stack_refusal(model) if self.native else "hyloop's CPU kernels are not loaded"
        if stack is True and why is not None:
            raise ValueError(f"model.cpu_stack=true: {why}")
        vectorised = torch.backends.cpu.get_cpu_capability() == "AVX512"
        if why is None and (stack is True or (stack == "auto" and vectorised)):
            self.stack = DecoderStack(model)
            if stack == "auto" and measure:
                # Kept only at the row counts where it was measured faster than the layers.
                self.stack.choice = choose_stack_rows(model, self.stack, [1, *rows], self.table)
                if not any(self.stack.choice.values()):
                    self.stack = None
        # The kernels are chosen: a weight-only layer's for good (one for every row count), and
        # the copy of its weight only the other kernel reads goes; so do a dense layer's panels
        # where no row count and no stack reads them.
        self.released_bytes = 0
        if self.native and measure:
            keep = self.stack is not None
            layers: list[Any] = [*self.quantized, *self.layers]
            self.released_bytes = sum(m.release_unused(keep_panels=keep) for m in layers)

    @property
    def measured(self) -> bool:
        return self.table is not None

    def calibrate_gemv(self) -> None:
        """Before a one-row step is compiled: time the compiled GEMV for one row too."""
        if self.measured:
            calibrate(self.layers, [1], with_gemv=True, tiled=self.native)

    def summary(self) -> dict[str, Any] | None:
        """What was measured and chosen (the run summary's ``cpu kernels`` lines)."""
        if self.table is None and self.stack is None:
            return None
        chosen = {shape_key(m.weight): dict(m.kernels) for m in self.layers}
        chosen |= {m.shape_key: dict(m.kernels) for m in self.quantized}
        return {
            "measured": self.table.measured if self.table is not None else 0,
            "measure_s": round(self.table.measure_s, 2) if self.table is not None else 0.0,
            "choices": chosen,
            "openmp": self.openmp,
            "stack": None if self.stack is None else self.stack.describe(),
            "released_mb": round(self.released_bytes / 2**20, 1),
        }


def _warn_spinning_waits(status: str) -> None:
    """Once per process: OpenMP threads that spin at barriers share a busy machine badly."""
    global _warned_policy
    if _warned_policy or torch.get_num_threads() < 2 or omp_policy.shares_cores_well():
        return
    _warned_policy = True
    log.warning(
        "hyloop: CPU steps run with OpenMP's %s: where another process takes a core, every "
        "parallel region waits for it (a compiled step most); set OMP_WAIT_POLICY=PASSIVE "
        "before torch is imported, or import hyloop first (hyloop/omp_policy.py)",
        status,
    )


__all__ = ["CpuKernels", "DecoderStack", "cpu_ops"]
