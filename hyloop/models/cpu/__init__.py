"""hyloop's CPU compute: Linears packed once for the kernel a fixed rule names
(``packed_linear``, ``kernel_choice``), the quantized layers' panels, the decoder stack, and the
C++ kernels (``cpu_ops``), set up once per model by ``CpuKernels``."""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any, Literal

import torch
from torch import nn

from hyloop import omp_policy
from hyloop.models.cpu import cpu_ops
from hyloop.models.cpu.decoder_stack import DecoderStack, stack_refusal
from hyloop.models.cpu.kernel_choice import bf16_dot, cpu_isa, dense_kernel, panels_vectorised
from hyloop.models.cpu.packed_linear import PackedLinear, pack_linears
from hyloop.models.quant.linear import WeightOnlyLinear

log = logging.getLogger(__name__)
_warned_policy = False


class CpuKernels:
    """A model's CPU kernels: the C++ kernels loaded (``native``: ``auto`` and ``True`` build them
    first where they are missing, ``False`` never loads them), every Linear packed for the one
    kernel its mode and dtype name (``kernel_choice``), the weight-only layers' panels, and the
    decoder stack for decode steps (``stack``: ``auto`` where the CPU has AVX-512)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        pack: bool,
        kernels: Literal["auto", "packed"] = "auto",
        native: Literal["auto"] | bool = "auto",
        stack: Literal["auto"] | bool = False,
    ) -> None:
        self.openmp = omp_policy.status()
        _warn_spinning_waits(self.openmp)
        self.native = native is not False and cpu_ops.ensure_loaded(build=True)
        self.layers: list[PackedLinear] = []
        if pack:
            pack_linears(model, lambda dtype: dense_kernel(dtype, self.native, kernels))
            self.layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        if self.native:
            cpu_ops.register_packed(model)
        self.quantized = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
        self.plain = [m for m in model.modules() if type(m) is nn.Linear]  # left to F.linear
        self.bf16_dot: str | None = None  # how bfloat16 panels run (kernel_choice.bf16_dot)
        if self.native and any(m.weight.dtype == torch.bfloat16 for m in self.layers):
            fma = cpu_ops.set_bf16_dot(bf16_dot(cpu_ops.bf16_dot_times) == "fma")
            self.bf16_dot = "float32 multiply-adds" if fma else "vdpbf16ps"
        # Integer GEMMs of many rows on AMX tiles where the CPU has them (the same bits);
        # HYLOOP_CPU_AMX=0 keeps them on the vector tiles.
        self.amx = self.native and cpu_ops.set_amx(os.environ.get("HYLOOP_CPU_AMX") != "0")
        if self.native:
            for layer in self.quantized:
                layer.attach_panels()
        self.stack: DecoderStack | None = None
        why = self._stack_refusal(model, kernels)
        if stack is True and why is not None:
            raise ValueError(f"model.cpu_stack=true: {why}")
        if why is None and (stack is True or (stack == "auto" and panels_vectorised())):
            self.stack = DecoderStack(model)

    def _stack_refusal(self, model: nn.Module, kernels: str) -> str | None:
        if not self.native:
            return "hyloop's CPU kernels are not loaded"
        if any(m.panels is None for m in self.layers):
            # The stack reads panels; a layer on another kernel would round decode steps
            # differently from the prefill chunks that run it.
            return f"the dense Linears run oneDNN here (model.cpu_kernels={kernels}, {cpu_isa()})"
        return stack_refusal(model)

    def numerics(self) -> str:
        """What the Linears compute, in a line (the run summary, ``RequestOutput.metrics``)."""
        parts = []
        quant = Counter(m.kind for m in self.quantized)
        if quant:
            where = "hyloop panels" if self.native else "torch reference"
            kinds = " + ".join(f"{k} x{n}" for k, n in sorted(quant.items()))
            if self.amx:
                where += ", AMX tiles for many rows"
            parts.append(f"{kinds}: 16-bit activations per group of 32, integer dots ({where})")
        dense = Counter((str(m.weight.dtype)[6:], m.kernel) for m in self.layers)
        dense.update((str(m.weight.dtype)[6:], "linear") for m in self.plain)
        names = {
            "tiled": "hyloop panels",
            "reference": "hyloop panels' chain (torch reference)",
            "packed": "oneDNN packed",
            "linear": "torch F.linear",
        }
        for (dt, k), n in sorted(dense.items()):
            how = f" ({self.bf16_dot})" if k == "tiled" and dt == "bfloat16" else ""
            parts.append(f"{dt} x{n}: {names[k]}{how}")
        where = "C++ kernels" if self.native else "torch reference, slower"
        parts.append(f"attention, RMSNorm, SiLU: hyloop's CPU definitions ({where})")
        if self.stack is not None:
            parts.append("decode layers in one stack")
        return "; ".join(parts)

    def summary(self) -> dict[str, Any]:
        """What runs where (the run summary's ``cpu kernels`` lines)."""
        chosen: dict[str, str] = {}
        for m in self.layers:
            chosen[f"{str(m.weight.dtype)[6:]} {m.out_features}x{m.in_features}"] = m.kernel
        for q in self.quantized:
            chosen[q.shape_key] = q.kernel
        return {
            "native": self.native,
            "isa": cpu_isa(),
            "numerics": self.numerics(),
            "choices": chosen,
            "openmp": self.openmp,
            "bf16_dot": self.bf16_dot,
            "amx": self.amx,
            "stack": None if self.stack is None else self.stack.describe(),
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
