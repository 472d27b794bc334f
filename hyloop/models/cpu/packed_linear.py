"""Linear layers whose weights are pre-packed once for the kernel that runs them on CPU.

A plain ``F.linear`` re-packs its weight matrix on every call; at decode batch sizes that
packing, not the arithmetic, dominates (the weights stream from memory once per step anyway),
so each weight is packed once at load time for its one kernel (``kernel_choice.dense_kernel``,
the same at every row count):

- ``tiled``: hyloop's panel GEMM (``panels.Panels``: ``hyloop::panel_linear``, outer-product
  tiles over 16-column panels, bfloat16 by vdpbf16ps where the CPU has it); those panels are
  what a decoder stack (``decoder_stack``) reads too;
- ``reference``: the panels' chain as its torch definition (``numerics.dense_linear``), where
  the C++ kernels are not loaded;
- ``packed``: oneDNN over a weight reordered once (its bf16 path uses AMX where the CPU has it);
- ``linear``: ``F.linear`` (oneDNN cannot pack the dtype here).

A ``PackedLinear`` runs as one operator, ``hyloop::linear``, whose CPU kernel is the eager
step's form and whose inductor decomposition the compiled step's: the same kernel as an opaque
call (``hyloop::panel_linear``, ``hyloop::packed_linear`` or the C++ ``packed_linear_native``
when the CPU kernels are loaded), so both compute the same bits. Nothing in the layer asks
whether it is being compiled.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._decomp import register_decomposition
from torch._inductor.decomposition import decompositions as inductor_decompositions

from hyloop.models.cpu import numerics
from hyloop.models.cpu.panels import Panels, gate_up_split

_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def packing_available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack a ``dtype`` weight here (its bf16 path needs AVX-512 or
    AVX-NE-CONVERT)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Plain operator definitions with CPU kernels, not ``torch.library.custom_op``: that wrapper's
# Python layers cost several times the dispatch of these.
_LIB = torch.library.Library("hyloop", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, int handle) -> Tensor")
# ``kernels``: the layer's kernel, spelled out so that it is part of every traced graph and of
# the compile caches' keys (an artifact built for another kernel is not reused).
_LIB.define(
    "linear(Tensor x, Tensor weight, Tensor? bias, Tensor? panels, int handle, str kernels) "
    "-> Tensor"
)


def _packed_linear_cpu(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _PACKED[handle].run_packed(x)


def _linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: torch.Tensor | None,
    handle: int,
    kernels: str,
) -> torch.Tensor:
    return _PACKED[handle].eager_form(x)


_LIB.impl("packed_linear", _packed_linear_cpu, "CPU")
_LIB.impl("linear", _linear_cpu, "CPU")
for _op in ("packed_linear", "linear"):  # inference only: no gradient through the packed copy
    _LIB.impl(_op, torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake("hyloop::packed_linear", lib=_LIB)
def _packed_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    layer = _PACKED[handle]
    return x.new_empty((*x.shape[:-1], layer.out_features))


@torch.library.register_fake("hyloop::linear", lib=_LIB)
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_decomposition(torch.ops.hyloop.linear.default, registry=inductor_decompositions)
def _linear_compiled(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: torch.Tensor | None,
    handle: int,
    kernels: str,
) -> torch.Tensor:
    return _PACKED[handle].compiled_form(x, weight, bias, panels)


packed_linear = torch.ops.hyloop.packed_linear.default
linear = torch.ops.hyloop.linear.default


class PackedLinear(nn.Module):
    """Drop-in for an ``nn.Linear`` (same parameters and names) plus its weight packed for
    ``kernel`` (``tiled``, ``packed`` or ``linear``). ``split``: the panels of a fused gate/up
    projection interleave its halves."""

    def __init__(
        self, linear: nn.Linear, kernel: str, batch_hint: int = 16, split: int = 0
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if hasattr(linear, "shard_sizes"):
            self.shard_sizes = linear.shard_sizes
        self.kernel = kernel
        self.packed: torch.Tensor | None = None
        self.panels: Panels | None = None
        with torch.no_grad():
            if kernel == "tiled":
                self.panels = Panels.dense(self.weight, split)
                self.register_buffer("panel_data", self.panels.data, persistent=False)
            elif kernel == "packed":
                w = self.weight.detach()
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self
        self.native = False  # registered with ``hyloop::packed_linear_native`` (``cpu_ops``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        panels = None if self.panels is None else self.panel_data
        return linear(x, self.weight, self.bias, panels, self.handle, self.kernel)

    def eager_form(self, x: torch.Tensor) -> torch.Tensor:
        """``hyloop::linear``'s CPU kernel (eager steps)."""
        if self.panels is not None:
            return self.panels.linear(x, self.bias)
        if self.kernel == "reference":
            return numerics.dense_linear(x, self.weight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self.run_packed(x)

    def compiled_form(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        panels: torch.Tensor | None,
    ) -> torch.Tensor:
        """``hyloop::linear`` as inductor lowers it (traced with static shapes): the eager
        kernel as an opaque call."""
        if panels is not None and self.panels is not None:
            p = self.panels
            return torch.ops.hyloop.panel_linear(x, panels, p.kind, p.n, p.k, p.split, p.half, bias)
        if self.kernel == "reference":
            return numerics.dense_op(x, weight, bias)
        if self.packed is None:
            return F.linear(x, weight, bias)
        if self.native:
            return torch.ops.hyloop.packed_linear_native(x, self.handle)
        return packed_linear(x, self.handle)

    def run_packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None, "no packed weight: oneDNN cannot pack this dtype here"
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


# Below this many weights the oneDNN call costs more than the re-packing it saves.
MIN_PACKED_WEIGHTS = 1 << 16


def pack_linears(model: nn.Module, kernel_for: Callable[[torch.dtype], str]) -> int:
    """Replace each large CPU ``nn.Linear`` of ``model`` by a ``PackedLinear`` for the kernel
    ``kernel_for(dtype)`` names (``linear`` layers are left as they are); returns how many."""
    count = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            w = child.weight
            kernel = kernel_for(w.dtype) if w.device.type == "cpu" else "linear"
            # Every Linear on the panels, small ones too: a decoder stack reads them all.
            small = w.numel() < MIN_PACKED_WEIGHTS and kernel not in ("tiled", "reference")
            if kernel != "linear" and not small:
                split = gate_up_split(f"{prefix}.{name}", w.shape[0])
                setattr(parent, name, PackedLinear(child, kernel, split=split))
                count += 1
    return count
