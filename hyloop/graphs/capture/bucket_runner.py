"""Run a step function through captured artifacts, one per batch / kv_len bucket and mode.

``BucketRunner(kind, buffer, backend=..., buckets=..., kv_len_buckets=...)`` replays
``kind.step`` on views of one ``CaptureBuffer``. ``run(batch)`` rounds the batch and
``kv_len`` up to their buckets, copies the rows into the buffer (the rest become inert padding
rows), replays the artifact and returns its outputs sliced to the real rows and cloned, so the
next replay cannot overwrite them. A batch above the largest bucket is split into bucket-sized
pieces (or run eagerly with ``oversize="eager"``); a ``kv_len`` above the largest ``kv_len``
bucket runs eagerly; prefill steps run eagerly. Every fallback is counted in ``stats()``.

Whether an artifact is captured when first needed is the runner's ``lazy`` setting; otherwise
only ``capture_keys`` captures (``graphs.backend=auto`` plans which), and a step whose artifact
does not exist runs eagerly, counted as ``uncaptured_steps``: a replay never waits on a compile.
An eager step runs ``kind.step`` on the batch as built (no padding, exact ``kv_len``, the eager
compute path and the all-greedy fast path): the oracle.

``kind.step`` must compute each row from that row's inputs alone, which is what makes padding
and splitting invisible. A runner is driven by one thread at a time; separate runners
(different models, backends) coexist in one process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

import torch

from hyloop.graphs.capture.backends import Backend, CapturedStep, CompiledStep, CudaGraphStep
from hyloop.graphs.capture.buckets import (
    ArtifactKey,
    normalize_buckets,
    pick_bucket,
    verify_buckets,
)
from hyloop.graphs.capture.buffer import CaptureBuffer
from hyloop.graphs.step_batch import ROW_FIELDS, StepBatch, StepOutput, StepPools

__all__ = ["BACKENDS", "BucketRunner", "CapturedKind", "check_batch"]

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("eager", "compile", "cuda_graph")


def _nothing() -> None:
    return None


class CapturedKind(Protocol):
    """What a runner captures: a step kind's step function (``pools`` are those of its eager
    steps) and what it needs before a capture."""

    pools: StepPools

    def step(self, batch: StepBatch) -> StepOutput: ...

    def prepare_capture(self, keys: Sequence[ArtifactKey]) -> None: ...


class BucketRunner:
    """Captured replay of ``kind.step`` with per-bucket artifacts and counted fallbacks."""

    def __init__(
        self,
        kind: CapturedKind,
        buffer: CaptureBuffer,
        *,
        backend: Backend = "compile",
        buckets: Sequence[int],
        kv_len_buckets: Sequence[int],
        oversize: Literal["split", "eager"] = "split",
        compile_in_graph: bool = False,
        compile_options: dict[str, Any] | None = None,
        name: str = "step",
        lazy: bool = True,
        verify_buffer: CaptureBuffer | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"BucketRunner backend: {backend!r}, expected one of {BACKENDS}")
        if oversize not in ("split", "eager"):
            raise ValueError(f"BucketRunner oversize: {oversize!r}, expected 'split' or 'eager'")
        self.device = buffer.full.input_ids.device
        if backend == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(f"BucketRunner backend 'cuda_graph': device {self.device}, not cuda")
        self.kind = kind
        self.buffer = buffer
        # verify steps' buffer (speculative decoding), and their positions-per-row buckets
        self.verify_buffer = verify_buffer
        k1 = verify_buffer.full.input_ids.shape[1] if verify_buffer is not None else 1
        self.verify_tokens = tuple(verify_buckets(k1 - 1)) if k1 > 1 else ()
        self.backend = backend
        self.buckets = normalize_buckets("BucketRunner buckets", buckets)
        self.kv_len_buckets = normalize_buckets("BucketRunner kv_len_buckets", kv_len_buckets)
        if self.buckets[-1] > buffer.max_bs:
            raise ValueError(f"BucketRunner buckets {self.buckets}: above {buffer.max_bs} rows")
        self.max_bs = self.buckets[-1]
        self.oversize = oversize
        self.compile_in_graph = compile_in_graph
        self.compile_options = dict(compile_options or {})
        self.name = name
        self.lazy = lazy
        self._artifacts: dict[ArtifactKey, CapturedStep] = {}
        self._compiled: list[CompiledStep] = []
        self._graph_pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._counts = dict.fromkeys(
            ("graph_replays", "eager_fallbacks", "split_batches", "uncaptured_steps"), 0
        )
        self._eager_steps = 0
        self._warned: set[str] = set()
        self.capture_seconds = 0.0  # capturing (compiling) so far
        self.capture_times: dict[ArtifactKey, float] = {}  # seconds each artifact took

    # -- capture --------------------------------------------------------------------------------
    def capture(
        self,
        kv_lens: Iterable[int] | None = None,
        modes: Iterable[tuple[int, int] | tuple[int, int, int]] = ((0, 0),),
    ) -> list[ArtifactKey]:
        """Capture every batch bucket, largest first, for each ``kv_len`` bucket (default: all)
        and mode; returns the keys now captured."""
        kv_keys = self.kv_len_buckets if kv_lens is None else [self.kv_bucket(k) for k in kv_lens]
        keys = [
            ArtifactKey(bs, kv, *mode)
            for mode in modes
            for kv in sorted({k for k in kv_keys if k is not None}, reverse=True)
            for bs in reversed(self.buckets)
        ]
        return self.capture_keys(keys)

    def capture_keys(self, keys: Iterable[ArtifactKey]) -> list[ArtifactKey]:
        """Capture exactly ``keys`` (those not captured yet); returns them."""
        keys = list(keys)
        if self.backend != "eager":
            missing = [k for k in keys if k not in self._artifacts]
            if missing:
                self.kind.prepare_capture(missing)
            for key in missing:
                self.artifact(key)
        return keys

    def kv_bucket(self, kv_len: int) -> int | None:
        """The ``kv_len`` bucket a step reading ``kv_len`` columns runs in (None: eager)."""
        return pick_bucket(self.kv_len_buckets, kv_len)

    def has_artifact(self, key: ArtifactKey) -> bool:
        return key in self._artifacts

    def artifact(self, key: ArtifactKey) -> CapturedStep:
        """``key``'s artifact, captured now if it does not exist yet."""
        artifact = self._artifacts.get(key)
        if artifact is not None:
            return artifact
        start = time.perf_counter()
        log.info("%s: capturing %s with %s", self.name, key.label(), self.backend)
        buffer = self.buffer if key.tokens == 1 else self.verify_buffer
        assert buffer is not None, f"{key.label()}: this runner has no verify buffer"
        view = buffer.view(
            key.batch, key.kv_len, key.top_cap, key.num_logprobs, key.features, key.tokens
        )
        # NOTE: warm-up and capture run on all-padding rows, which write only the padding sinks.
        CaptureBuffer.fill_padding(view)
        with torch.inference_mode():
            artifact = self._build(key, view)
        self._artifacts[key] = artifact
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        self.capture_times[key] = elapsed
        log.info("%s: captured %s with %s in %.2fs", self.name, key.label(), self.backend, elapsed)
        return artifact

    def drop(self, key: ArtifactKey) -> None:
        """Forget ``key``'s artifact (a later use captures it again)."""
        self._artifacts.pop(key, None)
        self._compiled = [c for c in self._compiled if c.key != key]

    def _build(self, key: ArtifactKey, view: StepBatch) -> CapturedStep:
        compiled = None
        if self.backend == "compile" or self.compile_in_graph:
            compiled = CompiledStep(
                self.kind.step, view, key, tag=self.name, options=self.compile_options
            )
            self._compiled.append(compiled)
        if self.backend == "compile":
            assert compiled is not None
            compiled.warm_up(2)
            return compiled
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        assert self._stream is not None
        fn: Callable[[StepBatch], Any] = self.kind.step if compiled is None else compiled
        graph = CudaGraphStep(fn, view, key, pool=self._graph_pool, stream=self._stream)
        graph.capture()
        if compiled is not None:
            compiled.check_warm(3)
        return graph

    # -- run ------------------------------------------------------------------------------------
    def run(self, batch: StepBatch, on_staged: Callable[[], None] | None = None) -> StepOutput:
        """One step: replay the bucket's artifact (or fall back, counted); outputs are owned.

        ``on_staged`` is called once, as soon as other host work may run beside the step: on
        CPU once the inputs sit in the buffer, just before the (synchronous) replay; on CUDA
        after every launch, outside the sync-debug guard (the guard's mode is process-wide, and
        a lazy capture must not see another thread's allocations)."""
        check_batch(batch)
        staged = on_staged or _nothing
        with torch.inference_mode():
            if self.device.type == "cuda":
                out = self._run(batch, _nothing)
                staged()
                return out
            return self._run(batch, staged)

    def _eager(self, batch: StepBatch, staged: Callable[[], None]) -> StepOutput:
        staged()
        out = self.kind.step(batch)
        if not batch.keep_logits:
            out.logits = None
        return out

    def _run(self, batch: StepBatch, staged: Callable[[], None]) -> StepOutput:
        captures = batch.is_decode or (batch.verify and self.verify_tokens)
        if self.backend == "eager" or not captures:
            self._eager_steps += self.backend == "eager"
            return self._eager(batch, staged)
        kv_bucket = self.kv_bucket(batch.kv_len)
        n = batch.batch_size
        if kv_bucket is None or (n > self.max_bs and self.oversize == "eager"):
            self._counts["eager_fallbacks"] += 1
            if kv_bucket is None:
                largest = self.kv_len_buckets[-1]
                self._warn_once("kv_len", f"kv_len {batch.kv_len} > {largest}: runs eager")
            else:
                self._warn_once("batch", f"batch {n} > bucket {self.max_bs}: runs eager")
            return self._eager(batch, staged)
        if n <= self.max_bs:
            return self._replay(batch, kv_bucket, staged)
        self._counts["split_batches"] += 1
        self._warn_once("split", f"batch {n} > bucket {self.max_bs}: split into pieces")
        pieces = [
            self._replay(
                batch.rows(i, min(n, i + self.max_bs)), kv_bucket, staged if not i else _nothing
            )
            for i in range(0, n, self.max_bs)
        ]
        return StepOutput.concat(pieces)

    def _warn_once(self, reason: str, detail: str) -> None:
        """Fallbacks cost speed silently; say so once per reason, then only count them."""
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("%s: %s (counted in stats(); warned once)", self.name, detail)

    def _replay(self, batch: StepBatch, kv_bucket: int, staged: Callable[[], None]) -> StepOutput:
        n = batch.batch_size
        bucket = pick_bucket(self.buckets, n)
        assert bucket is not None
        tokens = (
            1 if not batch.verify else pick_bucket(self.verify_tokens, batch.input_ids.shape[1])
        )
        assert tokens is not None, "a verify step has at most num_speculative_tokens + 1 positions"
        key = ArtifactKey(bucket, kv_bucket, *batch.mode, tokens)
        if not self.lazy and key not in self._artifacts:
            self._counts["uncaptured_steps"] += 1
            return self._eager(batch, staged)
        if key not in self._artifacts:
            self.capture_keys([key])
        artifact = self._artifacts[key]
        with artifact.replay_guard():
            CaptureBuffer.copy_from(artifact.static, batch)
            staged()
            out = artifact.replay().owned(n, batch.keep_logits)
        self._counts["graph_replays"] += 1
        return out

    # -- report ---------------------------------------------------------------------------------
    @property
    def replays(self) -> int:
        """Replays so far (cheap: read every step)."""
        return self._counts["graph_replays"]

    @property
    def recompiles(self) -> int:
        return sum(c.recompiles for c in self._compiled)

    def stats(self) -> dict[str, Any]:
        """Counters for the run summary; ``captured`` lists (batch, kv_len, top_cap, logprobs)."""
        return {
            "backend": self.backend,
            **self._counts,
            "eager_steps": self._eager_steps,
            "recompiles": self.recompiles,
            "captured": [k.fields() for k in sorted(self._artifacts)],
            "capture_s": round(self.capture_seconds, 3),
        }


def check_batch(batch: StepBatch) -> None:
    """Shapes, dtypes and static values of ``batch``; reads no tensor value (no host sync)."""
    b = batch.input_ids.shape[0]
    if b < 1:
        raise ValueError(f"StepBatch.input_ids: batch size {b}, expected >= 1")
    lead = tuple(batch.input_ids.shape[:2])
    for f in ROW_FIELDS:
        t = getattr(batch, f.name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"StepBatch.{f.name}: {got}, expected an int64 tensor")
        want = lead if f.metadata["tokens"] else (b,)
        dims = (2, 3) if f.name == "input_ids" else (len(want),)
        if tuple(t.shape[: len(want)]) != want or t.dim() not in dims:
            raise ValueError(f"StepBatch.{f.name}: shape {tuple(t.shape)}, expected {want}")
        if t.device != batch.input_ids.device:
            raise ValueError(f"StepBatch.{f.name}: on {t.device}, expected input_ids' device")
    for name, low in (("kv_len", 1), ("top_cap", 0), ("num_logprobs", 0)):
        value = getattr(batch, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"StepBatch.{name}: {value!r}, expected an int >= {low}")
