"""Which GEMM kernel each CPU Linear runs: a fixed rule of the mode, the dtype and the CPU's ISA,
the same for every row count, never a timing.

Kernels that round differently must never be chosen between by how fast they ran: a first run,
a busy machine and a warm one would compute other tokens. So each mode names one computation,
and the rule below only says which implementation of it runs here:

- a weight-only int4 / int8 Linear: 16-bit activations per group of 32 (``quant.reference``),
  on hyloop's panels where the CPU kernels are loaded, on torch's reference ops elsewhere (the
  same bits);
- a dense float32 / bfloat16 Linear (``model.cpu_kernels=auto``): hyloop's panel GEMM
  (``panels.h``: every output one sequential chain of fused multiply-adds over K, whatever the
  row count) where the CPU has AVX-512 (the ISA they are vectorised for; bfloat16 weights need
  its BF16 dot products too): the C++ panels where the kernels are loaded, their torch
  definition (``numerics.dense_linear``, ``reference``: the same bits, far slower) where they
  are not; on other CPUs oneDNN's GEMM over a weight packed once (``packed``), or ``F.linear``
  where oneDNN cannot pack the dtype (``linear``). ``model.cpu_kernels=packed`` names oneDNN
  everywhere.

So a dense row's bits follow the dtype and the ISA alone, never whether the kernels are built
(the quantized modes' bits are the same everywhere). ``HYLOOP_CPU_ISA`` names the ISA the rule
reads (``AVX512``,
``AVX2``, ``DEFAULT``) and ``HYLOOP_CPU_FLAGS`` the flags, so a test covers a CPU that lacks
one.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Literal

import torch

from hyloop.models.cpu.packed_linear import packing_available

DenseKernel = Literal["tiled", "reference", "packed", "linear"]


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


def panels_vectorised(dtype: torch.dtype | None = None) -> bool:
    """Whether hyloop's panel GEMMs and decoder stack run vectorised here: AVX-512, and for
    bfloat16 weights its BF16 dot products (``vdpbf16ps``; without them the bf16 tiles are
    scalar loops and oneDNN's packed GEMM is the rule)."""
    if cpu_isa() != "AVX512":
        return False
    return dtype != torch.bfloat16 or "avx512_bf16" in cpu_flags()


def dense_kernel(
    dtype: torch.dtype, native: bool, mode: Literal["auto", "packed"] = "auto"
) -> DenseKernel:
    """The kernel every dense Linear of ``dtype`` runs at every row count (``native``: hyloop's
    CPU kernels are loaded; where they are not, the panels' chain runs as its torch definition,
    ``reference``: the same bits)."""
    dense = dtype in (torch.float32, torch.bfloat16)
    if mode == "auto" and dense and panels_vectorised(dtype):
        return "tiled" if native else "reference"
    return "packed" if packing_available(torch.device("cpu"), dtype) else "linear"
