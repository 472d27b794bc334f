"""hyloop's CPU kernels (``cpu_ops.cpp``), built once per machine with the system C++ compiler.

- ``hyloop::decode_attention(q [B, Hq, D], k_buf, v_buf [slots, Hkv, D], slots [B, L] int64,
  bias [B, L] fp32, scale) -> [B, Hq, D]``: one query row per sequence over the paged pool, read
  in place at visible columns only (``bias != -inf``), so its cost follows the real context, not
  the kv_len bucket (inductor makes the column softmax a parallel reduction per row, and eager
  gathers and converts every column first).
- ``hyloop::topk_rows(x [B, V] fp32, k) -> (values, indices)``: the k largest per row,
  descending, ties to the lower index (a sampler's few candidates); ``hyloop::argmax_rows(x)
  -> [B]``: torch's argmax of each row (a NaN the largest, ties to the lower index), the
  greedy rows' token, split over the thread pool.
- ``hyloop::packed_linear_native(x, handle)``: ``PackedLinear``'s GEMM with no Python kernel, for
  a compiled step's C++ wrapper to call directly; ``register_packed`` hands it the weights.
- ``hyloop::pack_panels(weight [N, K] fp32 | bf16, split)``, ``pack_panels_i4(codes [N, K]
  uint8, scale, mins [N, K / 32] fp32, split, half)``, ``pack_panels_i8(codes [N, K] int8,
  scale [N, K / 32] fp32, split)`` -> uint8 panels (``cpu_panels.cpp``, layouts in
  ``panels.h``; large ones on huge pages), and ``hyloop::panel_linear(x [.., K], panels, kind,
  n, k, split, half, bias?) -> [.., N]`` in ``x``'s dtype (``panel_linear_live``, with a bool
  ``live`` a row after them: only those rows, the others zeros): the ``tiled`` kernel of every
  ``PackedLinear`` and weight-only Linear (``panels.Panels``); ``hyloop::set_bf16_dot(fma)``
  and ``hyloop::bf16_dot_times()``: which of two ways bfloat16 panels run (the same bits) and
  what each takes here (``kernel_choice.bf16_dot``); ``hyloop::set_amx(on)``: integer GEMMs of
  12 rows or more on AMX tiles where the CPU has them (``panels_amx.h``, the same bits);
- ``hyloop::decode_layers(x [B, H], handle, k_bufs!, v_bufs!, loc [B], slots [B, L],
  bias [B, L], cos, sin [B, rot], group=1) -> [B, H]`` (``cpu_decoder.cpp``):
  every decoder layer of a dense model for one new token per row, registered once with
  ``stack_create`` / ``stack_add_layer`` (``decoder_stack.DecoderStack``), writing each layer's
  K/V at ``loc`` (``group > 1``: runs of rows of one request that read each other's, a verify
  step's positions; ``decode_layers_live``, with a bool ``live [B]`` after ``group``: only those
  rows computed, the others zeros);
  ``stack_phase_times(handle, enable) -> [ranks, 7]`` float64 seconds per phase since the last
  call (``decoder_stack.PHASES``), and whether the steps that follow keep the clocks.

The GEMMs and attention split their work over hyloop's own thread pool (``cpu_pool.cpp``), not
OpenMP's regions: its workers spin between a step's kernels while the machine is quiet (no
halted vCPU to wake per kernel), the decoder stack runs as one team whose phases meet at
barriers, and while other processes want the cores a job takes fewer threads (the stack: as many
as there are free cores) or OpenMP's sleeping ones; ``HYLOOP_CPU_POOL=0`` always takes OpenMP
(and runs a team on one thread). ``hyloop::pool_cover(n, grain)`` is its test probe.

``layers.attention.NativePath`` is the compute path over the first two; ``bench/tts_frames.py``
and ``bench/decode_step.py`` measure what each saves.

The library is ``$HYLOOP_CACHE_DIR/cpu_ops/<key>.so``, keyed by the sources, torch, the CPU and the
flags (it is built with ``-march=native``; ``HYLOOP_CPU_MARCH`` names another target, e.g.
``x86-64-v3`` for an AVX2 CPU's kernels, with ``HYLOOP_CPU_ISA=AVX2`` for the rule). A missing
library is built when a model is about to load (once per machine, about 30 s on 2 cores, with a line
on stderr saying so and how long it took; processes building at once wait for one build). Without a
compiler, or when the build fails, it says why in one line and callers run the kernels' torch
definitions (``numerics``, ``quant.reference``), which compute the same bits, only slower.
``HYLOOP_CPU_OPS=0`` turns the kernels off."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

from hyloop.models.cpu import numerics
from hyloop.models.cpu.kernel_choice import cache_dir, cpu_description

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_ops.cpp", "cpu_pool.cpp", "cpu_panels.cpp", "cpu_decoder.cpp")
)
# Part of the library's key, not compiled on their own.
HEADERS = tuple(
    Path(__file__).with_name(n)
    for n in ("attend.h", "cpu_pool.h", "panels.h", "panels_amx.h", "panel_rows.h")
)

_LIB = torch.library.Library("hyloop", "FRAGMENT")
_LIB.define(
    "decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slots, Tensor bias, "
    "float scale) -> Tensor"
)


torch.library.register_fake("hyloop::decode_attention", numerics.contiguous_like, lib=_LIB)


def _argmax_rows_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.long)


def _topk_rows_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.long)


def _panel_linear_fake(
    x: torch.Tensor, panels: torch.Tensor, kind: int, n: int, *_: object
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))  # panel_linear, and panel_linear_live (``live``)


_lock = threading.Lock()
_state: dict[str, bool] = {}  # "loaded": the kernels are registered (absent: not tried yet)


def available() -> bool:
    """Whether the kernels are loaded (``ensure_loaded`` ran and succeeded)."""
    return _state.get("loaded", False)


def ensure_loaded(build: bool = True) -> bool:
    """Load the kernels, building them first when missing and ``build``; False when they cannot
    be had. The first answer stands, so a process never mixes the kernels with the torch
    paths."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load(build)
        return _state["loaded"]


def compile_options() -> dict[str, int | bool]:
    """Inductor options for a compiled CPU step. Its fused kernels round each bfloat16 value
    where eager ops round it (``emulate_precision_casts``: rotary, residual adds), so a compiled
    step computes an eager one's bits. With the kernels loaded, the step's heavy work (GEMMs,
    attention) runs on their pool, and inductor's own kernels (sampling, the glue on a few rows)
    run serially: at decode sizes each OpenMP region cost more in waking a sleeping thread than
    it saved (SmolLM2 bf16 batch 1: 64 -> 72-86 tok/s serial)."""
    threads: dict[str, int | bool] = {"cpp.threads": 1} if available() else {}
    return {"emulate_precision_casts": True, **threads}


def bf16_dot_times() -> tuple[float, float]:
    """Seconds of one small bfloat16 panel GEMM on the vdpbf16ps path and on the float32 path
    (``inf`` for the first where the build has no vdpbf16ps): ``kernel_choice.bf16_dot``'s
    measurement."""
    dot, fma = torch.ops.hyloop.bf16_dot_times()
    return float(dot), float(fma)


def set_bf16_dot(fma: bool) -> bool:
    """Run bfloat16 panels as float32 multiply-adds (``True``) or vdpbf16ps; returns the path
    now set (a build without vdpbf16ps stays on float32)."""
    return bool(torch.ops.hyloop.set_bf16_dot(fma))


def set_amx(on: bool) -> bool:
    """Let integer GEMMs of a few rows or more run on AMX tiles (the default) or not; returns
    whether they now do (``False`` where the CPU, Linux or the build has none). Their integer
    dot products are exact, so the bits are the same either way."""
    return bool(torch.ops.hyloop.set_amx(on))


def register_packed(model: torch.nn.Module) -> None:
    """Hand every packed Linear of ``model`` to ``hyloop::packed_linear_native`` (the loaded
    kernels' registry), so compiled steps call its GEMM with no Python in between."""
    from hyloop.models.cpu.packed_linear import PackedLinear

    for module in model.modules():
        if isinstance(module, PackedLinear) and module.packed is not None and not module.native:
            torch.ops.hyloop.register_packed(module.handle, module.packed, module.bias)
            weakref.finalize(module, torch.ops.hyloop.unregister_packed, module.handle)
            module.native = True


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    # -ffp-contract=off: a multiply and an add stay two roundings (the numerics that
    # ``numerics.py`` writes in torch ops); fused multiply-adds are the explicit ones.
    opts = [
        "-O3",
        f"-march={os.environ.get('HYLOOP_CPU_MARCH') or 'native'}",
        "-ffp-contract=off",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-fopenmp",
    ]
    return [*opts, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *libs, "-lc10", "-ltorch_cpu"]


def library_path() -> Path:
    cpu = cpu_description()
    parts = [
        *(s.read_text() for s in (*SOURCES, *HEADERS)),
        torch.__version__,
        cpu["model"],
        cpu["flags"],
        *_flags(),
    ]
    key = hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()
    return cache_dir() / "cpu_ops" / f"{key}.so"


def _load(build: bool) -> bool:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    path = library_path()
    why = None
    if os.environ.get("HYLOOP_CPU_OPS", "1") == "0":
        why = "off (HYLOOP_CPU_OPS=0)"
    elif not path.exists() and (compiler is None or not build):
        why = "no C++ compiler found" if compiler is None else "not built"
    if why is not None:
        log.warning("hyloop CPU kernels: %s; torch ops compute the same numerics, slower", why)
        return False
    try:
        if not path.exists():
            assert compiler is not None
            _build_once(compiler, path)
        # The ops whose CPU kernels the library adds are defined first.
        import hyloop.models.layers.norm  # noqa: F401  (hyloop::rms_norm)

        torch.ops.load_library(str(path))
        from hyloop.models.cpu.packed_linear import _packed_linear_fake

        # Same output as the Python-kernel hyloop::packed_linear.
        torch.library.register_fake("hyloop::packed_linear_native", _packed_linear_fake)
        torch.library.register_fake("hyloop::topk_rows", _topk_rows_fake)
        torch.library.register_fake("hyloop::argmax_rows", _argmax_rows_fake)
        torch.library.register_fake("hyloop::panel_linear", _panel_linear_fake)
        torch.library.register_fake("hyloop::panel_linear_live", _panel_linear_fake)
        torch.library.register_fake("hyloop::decode_layers", numerics.contiguous_like)
        torch.library.register_fake("hyloop::decode_layers_live", numerics.contiguous_like)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        log.warning(
            "hyloop CPU kernels unavailable (%s); torch ops compute the same numerics, slower",
            detail[-2000:],
        )
        return False
    return True


def _build_once(compiler: str, path: Path) -> None:
    """Build ``path`` unless another process is building it (then wait for that build)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        sys.stderr.write("hyloop: building the CPU kernels (once per machine) ...\n")
        t0 = time.perf_counter()
        _build(compiler, path)
        sys.stderr.write(f"hyloop: CPU kernels built in {time.perf_counter() - t0:.1f} s\n")


def _build(compiler: str, path: Path) -> None:
    """Each source to its own object, all at once (the slowest one sets the time: ~22 s where
    one after another took ~68 on 2 cores), then one link; in a folder beside the target, then
    renamed: processes building at once never load a partial file."""
    log.info("building hyloop CPU kernels into %s (once per machine)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = _flags()
    compile_flags = [f for f in flags if f != "-shared" and not f.startswith(("-L", "-l"))]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [os.path.join(tmp, f"{s.stem}.o") for s in SOURCES]
        jobs = [
            subprocess.Popen(
                [compiler, "-c", str(s), "-o", o, *compile_flags],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for s, o in zip(SOURCES, objects, strict=True)
        ]
        try:
            for job in jobs:
                out, err = job.communicate()
                if job.returncode:
                    raise subprocess.CalledProcessError(job.returncode, job.args, out, err)
        finally:
            for job in jobs:  # after a failure, the others are not waited out
                if job.poll() is None:
                    job.kill()
                job.wait()
        lib = os.path.join(tmp, path.name)
        link = [compiler, *objects, "-o", lib, *flags]
        subprocess.run(link, check=True, capture_output=True, text=True)
        os.replace(lib, path)
