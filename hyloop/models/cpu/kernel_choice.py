"""Which GEMM kernel each CPU Linear runs: a fixed rule of the mode, the dtype and the CPU's ISA,
the same for every row count, never a timing.

Kernels that round differently must never be chosen between by how fast they ran: a first run,
a busy machine and a warm one would compute other tokens. So each mode names one computation,
and the rule below only says which implementation of it runs here:

- a weight-only int4 / int8 Linear: 16-bit activations per group of 32 (``quant.reference``),
  on hyloop's panels where the CPU kernels are loaded (their exact integer dots on AMX tiles
  for 12 rows or more where the CPU has them, ``panels_amx.h``), on torch's reference ops
  elsewhere (the same bits);
- a dense float32 / bfloat16 Linear (``model.cpu_kernels=auto``): hyloop's panel GEMM
  (``panels.h``: every output one sequential chain of fused multiply-adds over K, whatever the
  row count) where the CPU has AVX-512 (the ISA they are vectorised for): the C++ panels where
  the kernels are loaded, their torch definition (``numerics.dense_linear``, ``reference``: the
  same bits, far slower) where they are not; on other CPUs oneDNN's GEMM over a weight packed
  once (``packed``), or ``F.linear`` where oneDNN cannot pack the dtype (``linear``).
  ``model.cpu_kernels=packed`` names oneDNN everywhere.

So a dense row's bits follow the dtype and the ISA alone, never whether the kernels are built
(the quantized modes' bits are the same everywhere). A bfloat16 chain runs one of two ways that
compute the same bits (``bf16_dot``): float32 fused multiply-adds over the weights widened in
registers, or ``vdpbf16ps`` where the CPU has AVX512_BF16 and it is the faster of the two here,
as measured once per process; since the bits are the same, a measurement may choose between
them. ``HYLOOP_CPU_ISA`` names the ISA the rule reads (``AVX512``, ``AVX2``, ``DEFAULT``) and
``HYLOOP_CPU_FLAGS`` the flags, so a test covers a CPU that lacks one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Literal, get_args

import torch

from hyloop.models.cpu.packed_linear import packing_available

DenseKernel = Literal["tiled", "reference", "packed", "linear"]
Bf16Dot = Literal["fma", "vdpbf16ps"]


def cache_dir() -> Path:
    """hyloop's cache directory: ``$HYLOOP_CACHE_DIR``, else ``~/.cache/hyloop``."""
    env = os.environ.get("HYLOOP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hyloop"


def cpu_description() -> dict[str, str]:
    """The CPU model name and flags as ``lscpu`` / ``/proc/cpuinfo`` give them."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and value.strip():
                model = value.strip()
            elif key == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
            if key == "flags" and model:
                break
    except OSError:
        pass
    return {"model": model, "flags": flags}


def machine_key() -> str:
    """What a machine's measured step times depend on: CPU model and flags, torch, threads, and
    hyloop's kernel sources."""
    cpu = cpu_description()
    parts = [cpu["model"], cpu["flags"], torch.__version__, str(torch.get_num_threads())]
    sources = [*Path(__file__).parent.glob("*.cpp"), *Path(__file__).parent.glob("*.h")]
    parts += [p.read_text() for p in sorted(sources)]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def cpu_isa() -> str:
    """The vector ISA the rule reads: torch's CPU capability, or ``$HYLOOP_CPU_ISA``."""
    return os.environ.get("HYLOOP_CPU_ISA") or torch.backends.cpu.get_cpu_capability()


def cpu_flags() -> set[str]:
    """The CPU's flags the rule reads: ``/proc/cpuinfo``'s, or ``$HYLOOP_CPU_FLAGS``."""
    env = os.environ.get("HYLOOP_CPU_FLAGS")
    return set((env if env is not None else cpu_description()["flags"]).split())


def panels_vectorised() -> bool:
    """Whether hyloop's panel GEMMs and decoder stack run vectorised here: AVX-512 (bfloat16
    weights too: without its BF16 dot products they run as float32 multiply-adds)."""
    return cpu_isa() == "AVX512"


def bf16_dot(measure: Callable[[], tuple[float, float]] | None) -> Bf16Dot:
    """How the bfloat16 panels run their chain (the same bits either way): ``$HYLOOP_BF16_DOT``
    where set; float32 multiply-adds where the CPU lacks AVX512_BF16; else whichever of
    ``measure()``'s (vdpbf16ps seconds, float32 seconds) is faster, vdpbf16ps unless the float32
    path takes under 0.9 of its time (on some CPUs vdpbf16ps issues at a quarter of the rate of
    float32 multiply-adds, on others at half or more)."""
    env = os.environ.get("HYLOOP_BF16_DOT")
    if env:
        if env not in get_args(Bf16Dot):
            raise ValueError(f"HYLOOP_BF16_DOT={env!r}: expected one of {get_args(Bf16Dot)}")
        return env  # type: ignore[return-value]
    if "avx512_bf16" not in cpu_flags():
        return "fma"
    if measure is None:
        return "vdpbf16ps"
    dot, fma = _measured(measure)
    return "fma" if fma < 0.9 * dot else "vdpbf16ps"


@functools.cache
def _measured(measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    return measure()


def dense_kernel(
    dtype: torch.dtype, native: bool, mode: Literal["auto", "packed"] = "auto"
) -> DenseKernel:
    """The kernel every dense Linear of ``dtype`` runs at every row count (``native``: hyloop's
    CPU kernels are loaded; where they are not, the panels' chain runs as its torch definition,
    ``reference``: the same bits)."""
    dense = dtype in (torch.float32, torch.bfloat16)
    if mode == "auto" and dense and panels_vectorised():
        return "tiled" if native else "reference"
    return "packed" if packing_available(torch.device("cpu"), dtype) else "linear"
