"""Which GEMM kernel each CPU Linear runs, chosen by timing the candidates on this machine.

The fastest way to multiply a few rows by a weight differs by CPU (vendor, AVX-512 or AMX,
oneDNN's and MKL's paths) and by row count, so at assembly each distinct Linear shape is timed
at every row count its steps will run (the batch buckets, a prefill chunk) and the fastest kept:

- ``linear``: plain ``F.linear`` (MKL / oneDNN, the weight re-packed per call);
- ``packed``: oneDNN on a weight packed once (its bf16 path uses AMX where the CPU has it);
- ``gemv``: one row as a multiply-reduce that inductor makes one vectorised, threaded kernel
  (one row, compiled steps only: eager would materialise the products);
- ``tiled``: hyloop's panel GEMM (``panels.h``, where the CPU kernels are loaded): outer-product
  tiles over the weight packed in 16-column panels.

Only the candidates that exist here are timed: no ``packed`` where oneDNN cannot pack the dtype
(bfloat16 without AVX-512-BF16 or AMX), no ``tiled`` without the CPU kernels.

Choices are kept in ``$HYLOOP_CACHE_DIR/kernels/<machine>.json`` (``$HYLOOP_KERNEL_TABLE_DIR``
moves them; keyed by CPU model and flags, torch version and thread count), so a later run here
measures nothing. Eager and captured steps
read the same choice for the same rows, so both compute the same thing.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
import os
import platform
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hyloop.models.cpu.packed_linear import packing_available
from hyloop.models.cpu.panels import Panels

log = logging.getLogger(__name__)

KERNELS = ("linear", "packed", "gemv", "tiled")
QUANT_KERNELS = ("aten", "tiled")  # a weight-only int4 / int8 Linear: torch's or hyloop's
STACK_KERNELS = ("stack", "layers")  # a decode step's layers as one call or one by one


# In a compiled step the GEMV fuses with its neighbours (norm before, activation after) and costs
# no extern call, which its isolated timing cannot show; the credit also keeps near-ties from
# splitting one step's layers between two kernels.
GEMV_CREDIT = 0.9


def cache_dir() -> Path:
    """hyloop's cache directory: ``$HYLOOP_CACHE_DIR``, else ``~/.cache/hyloop``."""
    env = os.environ.get("HYLOOP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hyloop"


def table_dir() -> Path:
    """Where this machine's kernel timings live: ``$HYLOOP_KERNEL_TABLE_DIR``, else
    ``cache_dir() / "kernels"`` (a test suite points it elsewhere: timings taken on shared cores
    must not become the machine's choices)."""
    env = os.environ.get("HYLOOP_KERNEL_TABLE_DIR")
    return Path(env) if env else cache_dir() / "kernels"


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
    """What a measured choice depends on: CPU model and flags, torch, threads."""
    cpu = cpu_description()
    parts = [cpu["model"], cpu["flags"], torch.__version__, str(torch.get_num_threads())]
    sources = [*Path(__file__).parent.glob("*.cpp"), *Path(__file__).parent.glob("*.h")]
    parts += [p.read_text() for p in sorted(sources)]  # ``tiled``
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def time_candidates(
    candidates: Mapping[str, Callable[[], object]],
    *,
    budget_s: float = 0.03,
    rounds: int = 3,
) -> dict[str, float]:
    """Microseconds per call of each candidate: the best of ``rounds`` interleaved rounds, each
    calling a candidate for about ``budget_s / rounds`` (at least twice), after a warm-up call.
    Interleaving keeps a noisy neighbour from favouring whichever ran in a quiet moment.

    Each call is timed alone after ``GAP_S`` of other work on this thread, as a step calls a
    kernel between its other operators: back to back, an OpenMP kernel finds its helper threads
    just finished and awake, where in a step they have gone to sleep (the passive wait policy)
    and each region pays for waking them (~80 us on a quiet 2-core VM, more than many of these
    kernels take)."""
    best = dict.fromkeys(candidates, float("inf"))
    calls: dict[str, int] = {}
    for name, fn in candidates.items():
        fn()  # warm-up: first-call allocation, primitive creation, compile
        t0 = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t0, 1e-6)
        calls[name] = max(2, min(500, int(budget_s / rounds / (once + GAP_S))))
    for _ in range(rounds):
        for name, fn in candidates.items():
            n = calls[name]
            total = 0.0
            for _ in range(n):
                _busy(GAP_S)
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
            best[name] = min(best[name], total / n * 1e6)
    return best


GAP_S = 50e-6  # other work between two kernels of a step (see ``time_candidates``)


def _busy(seconds: float) -> None:
    """Keep this thread busy (not asleep: a sleeping caller would idle its core too)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def fastest(timings: Mapping[str, float]) -> str:
    return min(timings, key=lambda name: timings[name])


@dataclass
class KernelTable:
    """Measured timings: ``entries[shape][rows] = {kernel: microseconds}``; ``shape`` is
    ``"<dtype> <out>x<in>"``. ``path`` is where it is kept (None: not kept)."""

    machine: str
    entries: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    path: Path | None = None
    measured: int = 0  # (shape, rows) timed by this process
    measure_s: float = 0.0

    @classmethod
    def load(cls, root: Path | None = None) -> KernelTable:
        """This machine's table under ``root / "kernels"`` (default ``table_dir()``); empty when
        absent or unreadable (a corrupt file is measured again, never trusted)."""
        machine = machine_key()
        path = (root / "kernels" if root is not None else table_dir()) / f"{machine}.json"
        table = cls(machine, path=path)
        try:
            data = json.loads(path.read_text())
            if data["machine"] != machine:
                return table
            for shape, by_rows in data["entries"].items():
                table.entries[shape] = {
                    int(r): {
                        k: float(v)
                        for k, v in us.items()
                        if k in (*KERNELS, *QUANT_KERNELS, *STACK_KERNELS)
                    }
                    for r, us in by_rows.items()
                }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            table.entries.clear()
        return table

    def save(self) -> None:
        """Write atomically (a concurrent engine reads either the old or the new file)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "machine": self.machine,
            "cpu": cpu_description()["model"],
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "entries": {
                shape: {str(r): us for r, us in sorted(by_rows.items())}
                for shape, by_rows in self.entries.items()
            },
        }
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def choices(self, shape: str, allowed: Iterable[str]) -> dict[int, str]:
        """Rows -> the fastest allowed kernel measured for them (the GEMV with ``GEMV_CREDIT``)."""
        allowed = set(allowed)
        out = {}
        for rows, us in self.entries.get(shape, {}).items():
            timed = {k: v for k, v in us.items() if k in allowed}
            if "gemv" in timed:
                timed["gemv"] *= GEMV_CREDIT
            if timed:
                out[rows] = fastest(timed)
        return out


def shape_key(weight: torch.Tensor) -> str:
    dtype = str(weight.dtype).removeprefix("torch.")
    return f"{dtype} {weight.shape[0]}x{weight.shape[1]}"


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache size (sysfs), 32 MiB when unknown."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError):
        return 32 * 2**20


def kernels_here(weight: torch.Tensor, tiled: bool) -> set[str]:
    """The kernels a Linear with this weight can run here (``tiled``: the CPU kernels are loaded
    for this engine)."""
    here = {"linear"}
    if packing_available(weight.device, weight.dtype):
        here.add("packed")
    if tiled and weight.device.type == "cpu":
        here.add("tiled")
    else:
        # With the CPU kernels loaded a compiled step runs inductor's own kernels on one thread
        # (``cpu_ops.compile_options``): its GEMV would too, and the panel GEMM reads a row's
        # weights as fast.
        here.add("gemv")
    return here


def _gemv(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = (w * x).sum(-1)
    return out if bias is None else out + bias


class LinearCandidates:
    """The kernels one Linear shape can run, each over weight copies that together exceed the
    last-level cache, called in turn: a decode step streams every weight from memory once,
    and timing one hot copy would measure the cache instead."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tiled: bool) -> None:
        stream = 2 * last_level_cache_bytes()
        n = max(1, min(32, -(-stream // (weight.numel() * weight.element_size()))))
        self.weights = [weight.clone() for _ in range(n)]  # all alike for the compiled GEMV
        self.packed = (
            [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in self.weights]
            if packing_available(weight.device, weight.dtype)
            else []
        )
        self.panels = [Panels.dense(w) for w in self.weights] if tiled else []
        self.bias = bias
        self._gemv: Callable[..., torch.Tensor] | None = None

    def for_rows(self, x: torch.Tensor, with_gemv: bool) -> dict[str, Callable[[], object]]:
        ws, packed, bias = self.weights, self.packed, self.bias
        turn = {name: itertools.count() for name in KERNELS}

        def nth(name: str, items: list[torch.Tensor]) -> torch.Tensor:
            return items[next(turn[name]) % len(items)]

        candidates: dict[str, Callable[[], object]] = {
            "linear": lambda: F.linear(x, nth("linear", ws), bias),
        }
        if packed:
            candidates["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
                x, nth("packed", packed), bias, "none", [], ""
            )
        if self.panels:
            panels = self.panels
            candidates["tiled"] = lambda: panels[next(turn["tiled"]) % len(panels)].linear(x, bias)
        if with_gemv and x.shape[0] == 1:
            if self._gemv is None:
                # A code object of its own per shape: Dynamo caches compiled code per code
                # object, and one shared by every shape would run into its recompile limit.
                w = ws[0]
                name = f"gemv_{str(w.dtype)[6:]}_{w.shape[0]}x{w.shape[1]}"
                code = _gemv.__code__.replace(co_name=name, co_qualname=name)
                fn = types.FunctionType(code, _gemv.__globals__, name)
                self._gemv = torch.compile(fn, fullgraph=True, dynamic=False)
            gemv = self._gemv
            candidates["gemv"] = lambda: gemv(nth("gemv", ws), x, bias)
        return candidates


def calibrate(
    layers: Iterable[Any],
    rows: Iterable[int],
    *,
    with_gemv: bool,
    tiled: bool = False,
    table: KernelTable | None = None,
    budget_s: float = 0.03,
) -> KernelTable:
    """Time every (shape, rows) of ``layers`` that ``table`` (loaded from the cache directory by
    default) lacks, keep the table, and hand each layer its choices (``set_kernels``)."""
    table = table if table is not None else KernelTable.load()
    layers = list(layers)
    rows = sorted(set(rows))
    allowed = KERNELS if with_gemv else tuple(k for k in KERNELS if k != "gemv")
    first: dict[str, Any] = {}
    for layer in layers:
        first.setdefault(shape_key(layer.weight), layer)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for shape, layer in first.items():
            by_rows = table.entries.setdefault(shape, {})
            available = [k for k in allowed if k in kernels_here(layer.weight, tiled)]
            kernels: LinearCandidates | None = None
            for r in rows:
                known = by_rows.get(r, {})
                wanted = [k for k in available if k != "gemv" or r == 1]
                if all(k in known for k in wanted):
                    continue
                kernels = kernels or LinearCandidates(layer.weight.detach(), layer.bias, tiled)
                x = torch.randn(r, layer.in_features, dtype=layer.weight.dtype)
                candidates = kernels.for_rows(x, with_gemv)
                timed = time_candidates(
                    {k: fn for k, fn in candidates.items() if k not in known}, budget_s=budget_s
                )
                by_rows[r] = {**known, **{k: round(v, 2) for k, v in timed.items()}}
                table.measured += 1
    table.measure_s += time.perf_counter() - t0
    if table.measured:
        try:
            table.save()
        except OSError as e:  # a read-only cache directory costs a re-measure, nothing else
            log.warning("hyloop: could not keep kernel choices in %s: %s", table.path, e)
        log.info("hyloop: timed %d kernel choices in %.1f s", table.measured, table.measure_s)
    for layer in layers:
        here = [k for k in allowed if k in kernels_here(layer.weight, tiled)]
        if layer.panels is None:  # never made, or released (``release_unused``)
            here = [k for k in here if k != "tiled"]
        layer.set_kernels(table.choices(shape_key(layer.weight), here))
    return table


def quantized_kernels(layer: Any) -> tuple[str, ...]:
    """What a weight-only layer can run: torch's kernel and, where it has panels, hyloop's; less
    the one whose copy of the weight it dropped (``release_unused``)."""
    here = QUANT_KERNELS if layer.panels is not None else ("aten",)
    return tuple(k for k in here if k != layer.released)


def _quantized_candidates(copies: list[Any], x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """A weight-only layer's kernels (``quantized_kernels``), each call on the next of
    ``copies``."""
    turn = itertools.count()

    def aten() -> object:
        layer = copies[next(turn) % len(copies)]
        return layer.matmul(x.to(torch.bfloat16)).float()

    def tiled() -> object:
        return copies[next(turn) % len(copies)].tiled(x)

    kernels = {"aten": aten, "tiled": tiled}
    return {k: kernels[k] for k in quantized_kernels(copies[0])}


def calibrate_quantized(
    layers: Iterable[Any],
    rows: Iterable[int],
    *,
    table: KernelTable | None = None,
    budget_s: float = 0.03,
) -> KernelTable:
    """As ``calibrate``, for weight-only int4 / int8 Linears (``quant.linear``): torch's kernel
    (``aten``) against hyloop's (``tiled``) at each row count, over copies of the layer that
    together exceed the last-level cache; each layer gets the faster."""
    table = table if table is not None else KernelTable.load()
    layers = list(layers)
    first: dict[str, Any] = {}
    for layer in layers:
        first.setdefault(layer.shape_key, layer)
    t0, measured = time.perf_counter(), table.measured
    with torch.inference_mode():
        for shape, layer in first.items():
            by_rows = table.entries.setdefault(shape, {})
            copies: list[Any] = []
            for r in sorted(set(rows)):
                known = by_rows.get(r, {})
                if all(k in known for k in quantized_kernels(layer)):
                    continue
                if not copies:
                    size = sum(b.numel() * b.element_size() for b in layer.buffers())
                    n = max(1, min(32, -(-2 * last_level_cache_bytes() // size)))
                    copies = [copy.deepcopy(layer) for _ in range(n)]
                candidates = _quantized_candidates(copies, torch.randn(r, layer.in_features))
                timed = time_candidates(
                    {k: fn for k, fn in candidates.items() if k not in known}, budget_s=budget_s
                )
                by_rows[r] = {**known, **{k: round(v, 2) for k, v in timed.items()}}
                table.measured += 1
    table.measure_s += time.perf_counter() - t0
    if table.measured > measured:
        try:
            table.save()
        except OSError as e:
            log.warning("hyloop: could not keep kernel choices in %s: %s", table.path, e)
    for layer in layers:
        kernels = quantized_kernels(layer)
        layer.set_kernels(_one_for_all_rows(table.entries.get(layer.shape_key, {}), kernels))
    return table


def _one_for_all_rows(
    by_rows: Mapping[int, Mapping[str, float]], kernels: Iterable[str] = QUANT_KERNELS
) -> dict[int, str]:
    """A weight-only layer's single kernel (``WeightOnlyLinear.set_kernels``): the one whose
    measured row counts take the least time together."""
    total = {k: sum(us.get(k, float("inf")) for us in by_rows.values()) for k in kernels}
    if not by_rows:
        return {}
    best = fastest(total)
    return dict.fromkeys(by_rows, best)
