"""Linear layers whose weights are pre-packed for oneDNN on CPU, with hyloop's panel GEMM beside.

A plain ``F.linear`` re-packs its weight matrix on every call; at decode batch sizes that
packing, not the arithmetic, dominates (the weights stream from memory once per step anyway),
so the weights are packed once at load time. Where hyloop's CPU kernels are loaded the layer
also holds its weight as panels (``panels.Panels``: ``hyloop::panel_linear``, outer-product
tiles over 16-column panels, bfloat16 by vdpbf16ps where the CPU has it), the ``tiled`` kernel;
those panels are what a decoder stack (``decoder_stack``) reads too. Where oneDNN cannot pack the
dtype (bfloat16 on a CPU without AVX-512-BF16 or AMX) the layer keeps no oneDNN copy.

A ``PackedLinear`` runs as one operator, ``hyloop::linear``, whose two forms are the two
kernels measured fastest on this machine (``kernel_choice``) for the row count at hand: its CPU
kernel is the eager step's choice, and its inductor decomposition the compiled step's, which
may be the one-row GEMV (a multiply-reduce inductor fuses with its neighbours), the few-row GEMM
or the packed GEMM as an opaque call (``hyloop::packed_linear``, or the C++
``packed_linear_native`` when the CPU kernels are loaded). Nothing in the layer asks whether it
is being compiled.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch._decomp import register_decomposition
from torch._inductor.decomposition import decompositions as inductor_decompositions

from hyloop.models.cpu.panels import Panels, drop_buffers, gate_up_split

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
# ``kernels``: the layer's measured choices, spelled out so that they are part of every traced
# graph and of the compile caches' keys (an artifact built under other choices is not reused).
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
def _linear_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: torch.Tensor | None,
    handle: int,
    kernels: str,
) -> torch.Tensor:
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
    """Drop-in for an ``nn.Linear`` (same parameters and names) plus a packed weight copy.

    ``kernels`` maps a row count to the kernel measured fastest for it on this machine
    (``kernel_choice``): ``linear``, ``packed`` (absent where oneDNN cannot pack the dtype),
    ``tiled`` (hyloop's panel GEMM, where its kernels are loaded: ``panels``) or ``gemv``
    (compiled steps only); a row count between two measured ones takes the choice of the next
    measured one above it, and one above every measured count (a prefill chunk) a GEMM built
    for many rows. ``split``: the panels of a fused gate/up projection interleave its halves.
    """

    def __init__(
        self, linear: nn.Linear, batch_hint: int = 16, panels: bool = False, split: int = 0
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if hasattr(linear, "shard_sizes"):
            self.shard_sizes = linear.shard_sizes
        self.packed: torch.Tensor | None = None
        if packing_available(self.weight.device, self.weight.dtype):
            with torch.no_grad():
                w = self.weight.detach()
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.panels: Panels | None = None
        if panels:
            self.panels = Panels.dense(self.weight, split)
            self.register_buffer("panel_data", self.panels.data, persistent=False)
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self
        self.kernels: tuple[tuple[int, str], ...] = ()  # (rows, kernel), rows ascending
        self.kernels_key = ""
        self.native = False  # registered with ``hyloop::packed_linear_native`` (``cpu_ops``)

    def set_kernels(self, kernels: dict[int, str]) -> None:
        self.kernels = tuple(sorted(kernels.items()))
        self.kernels_key = ",".join(f"{rows}:{kernel}" for rows, kernel in self.kernels)

    def release_unused(self, keep_panels: bool) -> int:
        """Once the kernels are measured: drop the panels where no row count runs them and no
        decoder stack reads them (``keep_panels``); returns the bytes dropped. A later choice
        no longer offers ``tiled`` (``kernel_choice.calibrate``)."""
        tiled = any(kernel == "tiled" for _, kernel in self.kernels)
        if keep_panels or tiled or not self.kernels or self.panels is None:
            return 0
        self.panels = None
        return drop_buffers(self, ("panel_data",))

    def kernel(self, rows: int, compiled: bool) -> str:
        """The measured kernel for ``rows`` rows; unmeasured, the packed GEMM (the GEMV for one
        row of a compiled step)."""
        for measured, kernel in self.kernels:
            if measured >= rows:
                return kernel
        many = "packed" if self.packed is not None else "linear"
        if self.kernels:
            kernel = self.kernels[-1][1]
            return many if kernel == "tiled" else kernel  # built for a few rows only
        return "gemv" if rows == 1 and compiled else many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        panels = None if self.panels is None else self.panel_data
        return linear(x, self.weight, self.bias, panels, self.handle, self.kernels_key)

    def eager_form(self, x: torch.Tensor) -> torch.Tensor:
        """``hyloop::linear``'s CPU kernel (eager steps): the GEMV pays only when fused."""
        kernel = self.kernel(x.numel() // self.in_features, compiled=False)
        if kernel == "tiled" and self.panels is not None:
            return self.panels.linear(x, self.bias)
        if kernel == "linear" or self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self.run_packed(x)

    def compiled_form(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        panels: torch.Tensor | None,
    ) -> torch.Tensor:
        """``hyloop::linear`` as inductor lowers it (traced with static shapes)."""
        rows = x.numel() // self.in_features
        kernel = self.kernel(rows, compiled=True)
        if kernel == "tiled" and panels is not None and self.panels is not None:
            p = self.panels
            return torch.ops.hyloop.panel_linear(x, panels, p.kind, p.n, p.k, p.split, p.half, bias)
        if kernel == "linear" or self.packed is None:
            return F.linear(x, weight, bias)
        if kernel == "gemv" and rows == 1:
            # One vectorised, threaded multiply-reduce: it can stream the weight faster than a
            # GEMM call on some CPUs.
            out = (weight * x.reshape(1, self.in_features)).sum(-1)
            out = out if bias is None else out + bias
            return out.view(*x.shape[:-1], self.out_features)
        if self.native:
            return torch.ops.hyloop.packed_linear_native(x, self.handle)
        return packed_linear(x, self.handle)

    def run_packed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None, "no packed weight: oneDNN cannot pack this dtype here"
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


# Below this many weights the oneDNN call costs more than the re-packing it saves.
MIN_PACKED_WEIGHTS = 1 << 16


def pack_linears(model: nn.Module, batch_hint: int = 16, tiled: bool = False) -> int:
    """Replace each large ``nn.Linear`` of ``model`` by a ``PackedLinear`` where it has a kernel
    to choose: oneDNN can pack its dtype here, or (``tiled``: the CPU kernels are loaded for this
    engine) hyloop's panel GEMM can run it, with its panels; returns how many."""
    count = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            big = type(child) is nn.Linear and child.weight.numel() >= MIN_PACKED_WEIGHTS
            w = child.weight if big else None
            on_cpu = w is not None and w.device.type == "cpu"
            panels = tiled and on_cpu and w.dtype in (torch.float32, torch.bfloat16)
            if w is not None and (packing_available(w.device, w.dtype) or panels):
                split = gate_up_split(f"{prefix}.{name}", w.shape[0])
                setattr(parent, name, PackedLinear(child, batch_hint, panels=panels, split=split))
                count += 1
    return count
