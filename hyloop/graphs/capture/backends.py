"""Capture backends: one captured artifact per ``ArtifactKey``, replayed on a static view.

* ``CompiledStep``: ``torch.compile(fullgraph=True, dynamic=False)`` of the step on one view.
  Every artifact compiles its own copy of a trampoline code object, so Dynamo keeps a separate
  cache per artifact: the recompile limit of one artifact never spills into another, and a
  recompile is detected per artifact by counting that code object's cache entries. This needs no
  process-wide compiler stance, so engines of different models and backends share a process.
  ``strict_stance=True`` additionally runs each replay under
  ``torch.compiler.set_stance("fail_on_recompile")`` so a recompile raises before compiling.
  That stance is process-wide: another thread that compiles during the replay would fail too.
  Otherwise, once warm, a replay runs the artifact's one compiled frame directly and Dynamo
  evaluates its guards on every ``GUARD_EVERY``-th replay only (a frame step checks about
  1,700; between two replays the step reads the same view). A guard that would fail still
  raises ``RecompileError``, up to ``GUARD_EVERY`` replays late.
* ``CudaGraphStep``: a ``torch.cuda.CUDAGraph`` around the eager or compiled step, warmed up on
  a side stream, captured into a memory pool the runner shares between its artifacts, and
  replayed under ``torch.cuda.set_sync_debug_mode("error")``. A replay does not run Python, so a
  Python value read by the step stays what it was at capture: nothing can detect that at replay
  time, which is why every per-step value must live in the static tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import types
from collections.abc import Callable
from typing import Any, Literal, Protocol, cast

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from hyloop.graphs.capture.buckets import ArtifactKey
from hyloop.graphs.safety import sync_debug_error
from hyloop.graphs.step_batch import StepBatch, StepOutput

__all__ = [
    "Backend",
    "CapturedStep",
    "CompiledStep",
    "CudaGraphStep",
    "RecompileError",
    "StepFn",
    "resolve_backend",
]

log = logging.getLogger(__name__)

Backend = Literal["eager", "compile", "cuda_graph"]

StepFn = Callable[[StepBatch], StepOutput]

_RECOMPILE_MESSAGE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
GUARD_EVERY = 32


class RecompileError(RuntimeError):
    """A captured step recompiled after warm-up: some value it specialised on changed."""

    def __init__(self, tag: str, key: ArtifactKey, detail: str) -> None:
        super().__init__(
            f"{tag}: {key.label()} recompiled after warm-up ({detail}); a value the step "
            "specialised on changed between replays (a Python scalar read by the step, a "
            "tensor shape, dtype or device, or global torch state such as grad mode). Per-step "
            "values must travel in the static input tensors."
        )
        self.tag = tag
        self.key = key


class CapturedStep(Protocol):
    """One artifact: ``static`` is the view it reads; ``replay()`` returns its raw outputs."""

    key: ArtifactKey
    static: StepBatch

    def replay(self) -> StepOutput: ...

    def replay_guard(self) -> contextlib.AbstractContextManager[None]: ...


def _trampoline(step_fn: StepFn, name: str) -> StepFn:
    """A function calling ``step_fn`` whose code object is new, so Dynamo caches it apart."""

    def trampoline(static: StepBatch) -> StepOutput:
        return step_fn(static)

    code = trampoline.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, trampoline.__globals__, name, None, trampoline.__closure__)


class CompiledStep:
    """``torch.compile(fullgraph=True, dynamic=False)`` of ``step_fn`` on one static view."""

    def __init__(
        self,
        step_fn: StepFn,
        static: StepBatch,
        key: ArtifactKey,
        *,
        tag: str,
        mode: str | None = None,
        strict_stance: bool = False,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.key = key
        self.static = static
        self.tag = tag
        self.strict_stance = strict_stance
        self.recompiles = 0
        name = f"hyloop_{tag}_b{key.batch}_kv{key.kv_len}_k{key.top_cap}_lp{key.num_logprobs}"
        fn = _trampoline(step_fn, "".join(c if c.isalnum() else "_" for c in name))
        self._fn = fn
        self._code = fn.__code__
        self._compiled = torch.compile(
            fn, fullgraph=True, dynamic=False, mode=mode, options=options or None
        )
        self._entries = 0
        self._direct: Callable[[StepBatch], Any] | None = None
        self._replays = 0

    @property
    def cache_entries(self) -> int:
        """Compiled variants Dynamo holds for this artifact (1 after a clean warm-up)."""
        return len(_debug_get_cache_entry_list(self._code))

    def __call__(self, static: StepBatch) -> Any:
        """The compiled step itself (what a CUDA graph captures around)."""
        return self._compiled(static)

    def warm_up(self, runs: int) -> Any:
        """Compile on the first run; later runs must hit that one compiled variant."""
        out = None
        for _ in range(max(1, runs)):
            out = self._compiled(self.static)
        self.check_warm(runs)
        return out

    def check_warm(self, runs: int) -> None:
        """After ``runs`` warm-up calls on identical inputs, exactly one variant must exist."""
        self._entries = self.cache_entries
        if self._entries != 1:
            raise RecompileError(
                self.tag,
                self.key,
                f"{self._entries} compiled variants after {runs} warm-up runs on identical inputs",
            )
        if not self.strict_stance:
            # Dynamo's transformed code for this frame: it unpacks the static view and calls
            # the compiled graph, without the guard evaluation around it.
            (entry,) = _debug_get_cache_entry_list(self._code)
            fn = self._fn
            self._direct = types.FunctionType(
                entry.code, fn.__globals__, fn.__name__, None, fn.__closure__
            )

    def replay(self) -> Any:
        self._replays += 1
        if self._direct is not None and self._replays % GUARD_EVERY:
            return self._direct(self.static)
        if not self.strict_stance:
            out = self._compiled(self.static)
        else:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    out = self._compiled(self.static)
            except RuntimeError as e:
                if _RECOMPILE_MESSAGE not in str(e):
                    raise
                self.recompiles += 1
                raise RecompileError(self.tag, self.key, "refused by fail_on_recompile") from e
        entries = self.cache_entries
        if entries != self._entries:
            self.recompiles += 1
            self._entries = entries
            self._direct = None
            raise RecompileError(self.tag, self.key, f"{entries} compiled variants now")
        return out

    def replay_guard(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class CudaGraphStep:
    """A CUDA graph of ``fn`` (the eager or compiled step) on one static view."""

    def __init__(
        self,
        fn: Callable[[StepBatch], Any],
        static: StepBatch,
        key: ArtifactKey,
        *,
        pool: Any,
        stream: torch.cuda.Stream,
        warmup_runs: int = 2,
    ) -> None:
        self.key = key
        self.static = static
        self._fn = fn
        self._pool = pool
        self._stream = stream
        self._warmup_runs = max(1, warmup_runs)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None

    def capture(self) -> None:
        """Warm up on the side stream (lazy init, autotuning, compiling), then capture."""
        device = self.static.input_ids.device
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(self._warmup_runs):
                self._fn(self.static)
        current.wait_stream(self._stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            self._outputs = self._fn(self.static)
        torch.cuda.synchronize(device)
        self.graph = graph

    def replay(self) -> Any:
        """Replay on the current stream; the outputs are the graph's static output tensors."""
        if self.graph is None:
            raise RuntimeError(f"{self.key.label()}: replay before capture")
        self.graph.replay()
        return self._outputs

    def replay_guard(self) -> contextlib.AbstractContextManager[None]:
        return sync_debug_error()


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on this machine (``$CXX``, else g++, c++ or clang++)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return any(shutil.which(n) for n in names)


def resolve_backend(name: str, device: torch.device) -> Backend:
    """``auto``: CUDA graphs on a GPU, ``torch.compile`` per bucket on CPU (eager on a CPU
    machine without the C++ compiler inductor needs)."""
    if name == "auto":
        if device.type == "cuda":
            return "cuda_graph"
        if not has_cpp_compiler():
            log.warning("hyloop: no C++ compiler found: graphs.backend=auto runs eager steps")
            return "eager"
        return "compile"
    if name == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"graphs.backend=cuda_graph needs a CUDA device, got device={device}")
    if name not in ("eager", "compile", "cuda_graph"):
        raise ValueError(f"graphs.backend={name!r}: expected auto, eager, compile or cuda_graph")
    return cast(Backend, name)
