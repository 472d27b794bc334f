"""Run a step function through captured artifacts, one per batch / kv_len bucket and mode.

``BucketRunner(step_fn, backend=..., buckets=..., kv_len_buckets=..., ...)`` owns the static
inputs of its artifacts. ``run(inputs)`` rounds the batch and ``kv_len`` up to their buckets,
copies the rows into the static buffers (the rest become inert padding rows), replays the
artifact and returns its outputs sliced to the real rows and cloned, so the next replay cannot
overwrite them. A batch above the largest bucket is split into bucket-sized pieces (or run eagerly
with ``oversize="eager"``); a ``kv_len`` above the largest ``kv_len`` bucket runs eagerly. Every
such fallback is counted in ``stats()``. A bucket is captured on first use, or with ``lazy=False``
only when ``capture`` / ``capture_keys`` asks: a step whose artifact does not exist then runs
eagerly (counted as ``uncaptured_steps``), so a replay never waits on a compile.

``step_fn(inputs: StepInputs)`` returns a tensor or a tuple / list / dict / dataclass of batch-major
tensors (``None`` and plain Python values pass through). It must compute each row from that row's
inputs alone, which is what makes padding and splitting invisible.

Backends: ``eager`` runs ``step_fn`` on the inputs as given (the oracle: no padding, exact
``kv_len``), ``compile`` and ``cuda_graph`` as in ``hyloop.graphs.backends``. A runner is driven by
one thread at a time; separate runners (different models, backends) coexist in one process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Literal

import torch

from hyloop.graphs.backends import CapturedStep, CompiledStep, CudaGraphStep, StepFn
from hyloop.graphs.buckets import ArtifactKey, normalize_buckets, pick_bucket
from hyloop.graphs.static_inputs import StaticInputs, StepInputs

__all__ = ["BACKENDS", "BucketRunner"]

log = logging.getLogger(__name__)


def _nothing() -> None:
    return None


Backend = Literal["eager", "compile", "cuda_graph"]
BACKENDS: tuple[str, ...] = ("eager", "compile", "cuda_graph")


class BucketRunner:
    """Captured replay of ``step_fn`` with per-bucket artifacts and counted fallbacks."""

    def __init__(
        self,
        step_fn: StepFn,
        *,
        backend: Backend = "compile",
        buckets: Sequence[int],
        kv_len_buckets: Sequence[int],
        device: torch.device | str,
        padding_row: int,
        channels: int | None = None,
        oversize: Literal["split", "eager"] = "split",
        compile_in_graph: bool = False,
        compile_mode: str | None = None,
        compile_options: dict[str, Any] | None = None,
        strict_stance: bool = False,
        warmup_runs: int = 2,
        name: str = "step",
        lazy: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"BucketRunner backend: {backend!r}, expected one of {BACKENDS}")
        if oversize not in ("split", "eager"):
            raise ValueError(f"BucketRunner oversize: {oversize!r}, expected 'split' or 'eager'")
        self.device = torch.device(device)
        if backend == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(f"BucketRunner backend 'cuda_graph': device {device}, expected cuda")
        self.step_fn = step_fn
        self.backend = backend
        self.buckets = normalize_buckets("BucketRunner buckets", buckets)
        self.kv_len_buckets = normalize_buckets("BucketRunner kv_len_buckets", kv_len_buckets)
        self.max_bs = self.buckets[-1]
        self.oversize = oversize
        self.compile_in_graph = compile_in_graph
        self.compile_mode = compile_mode
        self.compile_options = dict(compile_options or {})
        self.strict_stance = strict_stance
        self.warmup_runs = warmup_runs
        self.name = name
        self.lazy = lazy
        self.static = StaticInputs.init(
            self.max_bs,
            padding_row=padding_row,
            kv_len=self.kv_len_buckets[-1],
            device=self.device,
            channels=channels,
        )
        self._artifacts: dict[ArtifactKey, CapturedStep] = {}
        self._compiled: list[CompiledStep] = []
        self._graph_pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._counts = {
            "graph_replays": 0,
            "eager_fallbacks": 0,
            "split_batches": 0,
            "uncaptured_steps": 0,
        }
        self._eager_steps = 0
        self._warned: set[str] = set()
        self._capture_s = 0.0
        self.capture_times: dict[ArtifactKey, float] = {}  # seconds each artifact took

    # -- capture --------------------------------------------------------------------------------
    def capture(
        self,
        kv_lens: Iterable[int] | None = None,
        modes: Iterable[tuple[int, int]] = ((0, 0),),
    ) -> list[ArtifactKey]:
        """Capture every batch bucket, largest first, for each ``kv_len`` bucket and mode.

        ``kv_lens`` defaults to every ``kv_len`` bucket. Buckets used later without being
        captured here are captured lazily on first use. Returns the keys now captured.
        """
        if self.backend == "eager":
            return []
        kv_keys = self.kv_len_buckets if kv_lens is None else [self._kv_bucket(k) for k in kv_lens]
        keys = [
            ArtifactKey(bs, kv, cap, nlp)
            for cap, nlp in modes
            for kv in sorted({k for k in kv_keys if k is not None}, reverse=True)
            for bs in reversed(self.buckets)
        ]
        return self.capture_keys(keys)

    def capture_keys(self, keys: Iterable[ArtifactKey]) -> list[ArtifactKey]:
        """Capture exactly ``keys`` (those not captured yet); returns them."""
        keys = list(keys)
        if self.backend != "eager":
            for key in keys:
                self._artifact(key)
        return keys

    def kv_bucket(self, kv_len: int) -> int | None:
        """The ``kv_len`` bucket a step reading ``kv_len`` columns runs in (None: eager)."""
        return self._kv_bucket(kv_len)

    def has_artifact(self, key: ArtifactKey) -> bool:
        return key in self._artifacts

    def replays_eagerly(self, inputs: StepInputs) -> bool:
        """A non-lazy runner that holds no artifact for ``inputs`` (one bucket, no split): its
        step would run ``step_fn`` uncaptured. The caller may run its own eager step instead,
        free of the captured step's constraints (e.g. sampling's all-greedy fast path), and
        report it with ``count_uncaptured``."""
        if self.lazy or self.backend == "eager" or inputs.batch_size > self.max_bs:
            return False
        kv_bucket = self._kv_bucket(inputs.kv_len)
        if kv_bucket is None:
            return False
        bucket = pick_bucket(self.buckets, inputs.batch_size)
        assert bucket is not None
        return ArtifactKey(bucket, kv_bucket, *inputs.mode) not in self._artifacts

    def count_uncaptured(self) -> None:
        self._counts["uncaptured_steps"] += 1

    def _kv_bucket(self, kv_len: int) -> int | None:
        return pick_bucket(self.kv_len_buckets, kv_len)

    def _artifact(self, key: ArtifactKey) -> CapturedStep:
        artifact = self._artifacts.get(key)
        if artifact is not None:
            return artifact
        start = time.perf_counter()
        log.info("%s: capturing %s with %s (first use)", self.name, key.label(), self.backend)
        static = self.static.view(
            key.batch, kv_len=key.kv_len, top_cap=key.top_cap, num_logprobs=key.num_logprobs
        )
        # NOTE: warm-up and capture run on all-padding rows, which write only the padding sinks.
        static.fill_padding()
        with torch.inference_mode():
            artifact = self._build(key, static)
        self._artifacts[key] = artifact
        elapsed = time.perf_counter() - start
        self._capture_s += elapsed
        self.capture_times[key] = elapsed
        log.info("%s: captured %s with %s in %.2fs", self.name, key.label(), self.backend, elapsed)
        return artifact

    def _build(self, key: ArtifactKey, static: StaticInputs) -> CapturedStep:
        compiled = None
        if self.backend == "compile" or self.compile_in_graph:
            compiled = CompiledStep(
                self.step_fn,
                static,
                key,
                tag=self.name,
                mode=self.compile_mode,
                strict_stance=self.strict_stance,
                options=self.compile_options,
            )
            self._compiled.append(compiled)
        if self.backend == "compile":
            assert compiled is not None
            compiled.warm_up(self.warmup_runs)
            return compiled
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        assert self._stream is not None
        fn: Callable[[StaticInputs], Any] = self.step_fn if compiled is None else compiled
        graph = CudaGraphStep(
            fn,
            static,
            key,
            pool=self._graph_pool,
            stream=self._stream,
            warmup_runs=self.warmup_runs,
        )
        graph.capture()
        if compiled is not None:
            compiled.check_warm(self.warmup_runs + 1)
        return graph

    def time_key(self, key: ArtifactKey, runs: int = 5) -> tuple[list[float], list[float]]:
        """Seconds of ``runs`` replays of ``key``'s artifact (captured first if need be) and of
        ``runs`` eager steps on the same all-padding inputs (``hyloop warmup``'s figures)."""
        artifact = self._artifact(key)
        static = artifact.static
        static.fill_padding()
        cuda = self.device.type == "cuda"

        def timed(fn: Callable[[], Any]) -> list[float]:
            out = []
            for _ in range(runs):
                if cuda:
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize(self.device)
                out.append(time.perf_counter() - t0)
            return out

        with torch.inference_mode():
            return timed(artifact.replay), timed(lambda: self.step_fn(static))

    def recapture(self, key: ArtifactKey) -> float:
        """Drop ``key``'s artifact and capture it again after resetting Dynamo, as a new
        process would (inductor's on-disk cache warm); returns the seconds it took."""
        self._artifacts.pop(key, None)
        self._compiled = [c for c in self._compiled if c.key != key]
        torch._dynamo.reset()
        self._artifact(key)
        return self.capture_times[key]

    # -- run ------------------------------------------------------------------------------------
    def run(
        self,
        inputs: StepInputs,
        on_staged: Callable[[], None] | None = None,
        drop: Collection[str] = (),
    ) -> Any:
        """One step: replay the bucket's artifact (or fall back, counted); outputs are owned.

        ``on_staged`` is called once, as soon as other host work may run beside the step: on
        CPU once the inputs sit in the static buffers, just before the (synchronous) replay; on
        CUDA after every launch, outside the sync-debug guard (the guard's mode is process-wide,
        and a lazy capture must not see another thread's allocations). ``drop`` names dict keys
        or dataclass fields not to copy out (a replay still computes them into its static
        buffers; a dropped dataclass field reads None).
        """
        inputs.validate()
        staged = on_staged or _nothing
        if self.device.type == "cuda":
            out = self._run(inputs, _nothing, drop)
            staged()
            return out
        return self._run(inputs, staged, drop)

    def _run(self, inputs: StepInputs, staged: Callable[[], None], drop: Collection[str]) -> Any:
        with torch.inference_mode():
            if self.backend == "eager":
                self._eager_steps += 1
                staged()
                return self.step_fn(inputs)
            kv_bucket = self._kv_bucket(inputs.kv_len)
            n = inputs.batch_size
            if kv_bucket is None or (n > self.max_bs and self.oversize == "eager"):
                self._counts["eager_fallbacks"] += 1
                if kv_bucket is None:
                    largest = self.kv_len_buckets[-1]
                    self._warn_once("kv_len", f"kv_len {inputs.kv_len} > {largest}: runs eager")
                else:
                    self._warn_once("batch", f"batch {n} > bucket {self.max_bs}: runs eager")
                staged()
                return self.step_fn(inputs)
            if n <= self.max_bs:
                return self._replay(inputs, kv_bucket, staged, drop)
            self._counts["split_batches"] += 1
            self._warn_once("split", f"batch {n} > bucket {self.max_bs}: split into pieces")
            pieces = [
                self._replay(
                    inputs.rows(i, min(n, i + self.max_bs)),
                    kv_bucket,
                    staged if i == 0 else _nothing,
                    drop,
                )
                for i in range(0, n, self.max_bs)
            ]
            return _concat(pieces)

    def _warn_once(self, reason: str, detail: str) -> None:
        """Fallbacks cost speed silently; say so once per reason, then only count them."""
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("%s: %s (counted in stats(); warned once)", self.name, detail)

    def _replay(
        self,
        inputs: StepInputs,
        kv_bucket: int,
        on_staged: Callable[[], None] = _nothing,
        drop: Collection[str] = (),
    ) -> Any:
        n = inputs.batch_size
        bucket = pick_bucket(self.buckets, n)
        assert bucket is not None
        key = ArtifactKey(bucket, kv_bucket, *inputs.mode)
        if not self.lazy and key not in self._artifacts:
            self._counts["uncaptured_steps"] += 1
            on_staged()
            return self.step_fn(inputs)
        artifact = self._artifact(key)
        with artifact.replay_guard():
            artifact.static.copy_from(inputs)
            on_staged()
            raw = artifact.replay()
            if drop:
                raw = _drop(raw, drop)
            out = _map_tensors(raw, lambda path, t: _owned_rows(self.name, path, t, bucket, n))
        self._counts["graph_replays"] += 1
        return out

    # -- report ---------------------------------------------------------------------------------
    @property
    def replays(self) -> int:
        """Replays so far (cheap: read every step)."""
        return self._counts["graph_replays"]

    @property
    def capture_seconds(self) -> float:
        return self._capture_s

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
            "captured": [dataclasses.astuple(k) for k in sorted(self._artifacts)],
            "capture_s": round(self._capture_s, 3),
        }


def _owned_rows(tag: str, path: str, t: torch.Tensor, bucket: int, n: int) -> torch.Tensor:
    """The real rows of a batch-major output, in fresh memory the next replay cannot touch."""
    if t.dim() == 0 or t.shape[0] != bucket:
        raise ValueError(
            f"{tag}: step output {path} has shape {tuple(t.shape)}, expected batch-major "
            f"[{bucket}, ...] for the batch bucket {bucket}"
        )
    return t[:n].clone()


def _map_tensors(out: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str = "") -> Any:
    """Apply ``fn(path, tensor)`` to every tensor of a tuple/list/dict/dataclass tree."""
    if isinstance(out, torch.Tensor):
        return fn(path or "<output>", out)
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        items = zip(out._fields, out, strict=True)
        return type(out)(*(_map_tensors(v, fn, f"{path}.{f}") for f, v in items))
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(out))
    if isinstance(out, dict):
        return {k: _map_tensors(v, fn, f"{path}[{k!r}]") for k, v in out.items()}
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        fields = [f.name for f in dataclasses.fields(out) if f.init]
        return dataclasses.replace(
            out, **{f: _map_tensors(getattr(out, f), fn, f"{path}.{f}") for f in fields}
        )
    return out


def _drop(out: Any, names: Collection[str]) -> Any:
    """``out`` without the named dict entries or dataclass fields (those read None)."""
    if isinstance(out, dict):
        return {k: v for k, v in out.items() if k not in names}
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{n: None for n in names if hasattr(out, n)})
    return out


def _concat(parts: list[Any]) -> Any:
    """Join the outputs of a split batch along the batch dimension."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_concat(list(vs)) for vs in zip(*parts, strict=True)))
    if isinstance(first, (tuple, list)):
        return type(first)(_concat(list(vs)) for vs in zip(*parts, strict=True))
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        return dataclasses.replace(
            first, **{f: _concat([getattr(p, f) for p in parts]) for f in fields}
        )
    return first
