"""Linear layers whose weights are pre-packed for oneDNN on CPU.

A plain ``F.linear`` re-packs its weight matrix on every call; at decode batch sizes that
packing, not the arithmetic, dominates (the weights stream from memory once per step anyway).
Packing once at load time makes the CPU GEMMs 2-2.5x faster at batch 1-16, fp32 and bf16.

The packed GEMM is a custom op (``hyloop::packed_linear``) keyed by a handle into a registry of
packed weights, so a ``torch.compile``'d step calls it as an opaque kernel and fuses the rest.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def packing_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


# A plain operator definition with a CPU kernel, not ``torch.library.custom_op``: that
# wrapper's Python layers cost ~13 us a call (92 calls in a TTS frame step: ~1.2 ms), this
# path ~1 us on top of the GEMM itself.
_LIB = torch.library.Library("hyloop", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, int handle) -> Tensor")


def _packed_linear_cpu(x: torch.Tensor, handle: int) -> torch.Tensor:
    layer = _PACKED[handle]
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


_LIB.impl("packed_linear", _packed_linear_cpu, "CPU")


@torch.library.register_fake("hyloop::packed_linear", lib=_LIB)
def _packed_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    layer = _PACKED[handle]
    return x.new_empty((*x.shape[:-1], layer.out_features))


packed_linear = torch.ops.hyloop.packed_linear


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` (same parameters and names) plus a packed weight copy.

    ``kernels`` maps a row count to the kernel measured fastest for it on this machine
    (``kernel_choice``): ``linear``, ``packed`` or ``gemv``; a row count between two measured
    ones takes the choice of the next measured one above it. Unmeasured (empty), it runs the
    packed GEMM, and a single row as the GEMV under ``torch.compile``.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 16) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if hasattr(linear, "shard_sizes"):
            self.shard_sizes = linear.shard_sizes
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self
        self.kernels: tuple[tuple[int, str], ...] = ()  # (rows, kernel), rows ascending
        self.native = False  # registered with ``hyloop::packed_linear_native`` (``cpu_ops``)

    def set_kernels(self, kernels: dict[int, str]) -> None:
        self.kernels = tuple(sorted(kernels.items()))

    def kernel(self, rows: int) -> str:
        """The kernel for ``rows`` rows (a static shape under compile: read at trace time)."""
        for measured, kernel in self.kernels:
            if measured >= rows:
                return kernel
        if self.kernels:
            return self.kernels[-1][1]
        return "gemv" if rows == 1 and torch.compiler.is_compiling() else "packed"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x.numel() // self.in_features)
        if kernel == "linear":
            return F.linear(x, self.weight, self.bias)
        if kernel == "gemv" and x.numel() == self.in_features and torch.compiler.is_compiling():
            return self.run_gemv(x)  # eagerly the multiply-reduce would allocate W * x: packed
        if torch.compiler.is_compiling():  # opaque to inductor
            if self.native:
                return torch.ops.hyloop.packed_linear_native(x, self.handle)
            return packed_linear(x, self.handle)
        return self.run_packed(x)

    def run_packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def run_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """``W @ x`` for one row as a multiply-reduce that inductor turns into one vectorized,
        threaded kernel (it can stream the weight faster than a GEMM call on some CPUs)."""
        out = (self.weight * x.reshape(1, self.in_features)).sum(-1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


# Below this many weights the oneDNN call costs more than the re-packing it saves.
MIN_PACKED_WEIGHTS = 1 << 16


def pack_linears(model: nn.Module, batch_hint: int = 16) -> int:
    """Replace each large ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.numel() >= MIN_PACKED_WEIGHTS:
                setattr(parent, name, PackedLinear(child, batch_hint))
                count += 1
    return count
