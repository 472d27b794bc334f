"""The token step kind: a model's decode/prefill step behind one backend.

``prepare(batch)`` builds a ``PreparedStep`` (captured decode inputs, or an eager context) and
``execute(prepared)`` runs it, through the bucket runner's captured artifacts where the step is
a decode step and a graph backend is in use, eagerly otherwise. A frame step (TTS,
``frame_step.FrameRunner``) is another step function behind the same calls: the pipeline and
its loops drive either.

Under ``graphs.backend=auto`` nothing is captured on first use: ``plan_job`` captures, at a
job's first decode step, the artifacts that job pays for (``graphs.auto_plan``) and every other
step runs eagerly. Decode step times are measured into this machine's ``StepHistory`` so that
later plans use real figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

from hyloop.framework.batch import Batch
from hyloop.framework.config import GraphsSection
from hyloop.framework.step_fn import SamplingTensors, StepOutput, run_step
from hyloop.framework.step_inputs import InputBuilder
from hyloop.graphs.auto_plan import Estimates, Outlook, Plan, choose, simulate
from hyloop.graphs.bucket_runner import BucketRunner
from hyloop.graphs.buckets import ArtifactKey, kv_len_buckets, pick_bucket
from hyloop.graphs.context import StepContext
from hyloop.graphs.history import StepHistory
from hyloop.graphs.sampler import token_hashes
from hyloop.graphs.static_inputs import StepInputs
from hyloop.pools import KVPool, RecurrentPool, ReqToTokenPool

Backend = Literal["eager", "compile", "cuda_graph"]

log = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    """A step ready to launch: captured decode ``inputs``, or an eager ``context``."""

    batch: Batch
    sampling: SamplingTensors
    inputs: StepInputs | None = None  # a captured decode step
    context: StepContext | None = None  # an eager step (prefill, or the eager backend)
    greedy_only: bool = False  # every row is greedy (an uncaptured decode step skips noise)

    def bind_input_ids(self, ids: torch.Tensor, row_shape: tuple[int, ...]) -> None:
        """Set the input ids (``[B]`` or ``[B, C]``, on device) of a decode step."""
        ids = ids.view(-1, 1, *row_shape)
        self.batch.input_ids = ids
        if self.inputs is not None:
            self.inputs.input_ids = ids
        if self.context is not None:
            self.context.input_ids = ids


class StepKind(Protocol):
    """What the pipeline drives: a model step behind a backend."""

    device: torch.device
    row_shape: tuple[int, ...]

    def prepare(self, batch: Batch) -> PreparedStep: ...

    def execute(
        self,
        prepared: PreparedStep,
        keep_logits: bool = False,
        on_staged: Callable[[], None] | None = None,
    ) -> StepOutput: ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Owns the model step and its backend; ``backend`` is the one in use, never ``auto``."""

    # How this kind builds its step inputs (and reads a request's sampling for them).
    input_builder: type[InputBuilder] = InputBuilder
    # Inductor options a compiled step of this kind takes on CPU unless the config sets them.
    cpu_compile_options: dict[str, Any] = {}

    def __init__(
        self,
        model: nn.Module,
        kv: KVPool,
        req_to_token: ReqToTokenPool,
        vocab_size: int,
        device: torch.device,
        recurrent: RecurrentPool | None = None,
        graphs: GraphsSection | None = None,
        row_channels: int = 0,
    ) -> None:
        self.model = model
        self.device = device
        self.tok_hash = token_hashes(vocab_size, device)
        self.row_shape: tuple[int, ...] = (row_channels,) if row_channels else ()
        self.inputs = self.input_builder(
            req_to_token, kv, recurrent, vocab_size, device, self.row_shape
        )
        graphs = graphs or GraphsSection()
        self.backend: Backend = resolve_backend(graphs.backend, device)
        self.auto = graphs.backend == "auto" and self.backend != "eager"
        self.buckets = usable_buckets(graphs.buckets, req_to_token.max_requests)
        self.max_requests = req_to_token.max_requests
        self.graph_runner: BucketRunner | None = None
        self.history: StepHistory | None = None  # measured figures (``attach_history``)
        self.defaults: Estimates | None = None
        self.plan: Plan | None = None  # auto: the latest job's plan
        self.auto_capture_s = 0.0  # auto: capture time before first decode steps
        self.before_capture: Callable[[list[ArtifactKey]], None] | None = None
        self._plan_due = True
        if self.backend != "eager":
            step = kv_len_buckets(
                req_to_token.max_context,
                multiple=graphs.kv_len_bucket or None,
                pow2=graphs.kv_len_bucket == 0,
            )
            self.graph_runner = BucketRunner(
                self.graph_step,
                backend=self.backend,
                buckets=self.buckets,
                kv_len_buckets=step,
                device=device,
                padding_row=req_to_token.padding_row,
                channels=row_channels or None,
                oversize=graphs.oversize,
                compile_in_graph=graphs.compile_in_graph,
                compile_options=compile_options(graphs, device, self.cpu_compile_options),
                name=f"decode-{type(model).__name__}-{id(self):x}",
                lazy=not self.auto,
            )

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self.inputs.to_device(host)

    # -- the captured unit ----------------------------------------------------------------------
    def step(self, ctx: StepContext, st: SamplingTensors, keep_logits: bool) -> StepOutput:
        """The step function of this kind: one forward + sample (``run_step``)."""
        return run_step(self.model, ctx, st, self.tok_hash, keep_logits)

    def graph_step(self, inputs: StepInputs) -> StepOutput:
        """The unit a backend captures: one decode step over static inputs."""
        return self.step(self.inputs.context(inputs), SamplingTensors.of(inputs), True)

    # -- prepare / execute ----------------------------------------------------------------------
    def prepare(self, batch: Batch) -> PreparedStep:
        """Host work of a step: its inputs as device tensors (captured decode or eager)."""
        if not batch.is_decode:
            ctx, sampling = self.inputs.prefill(batch)
            return PreparedStep(batch, sampling, context=ctx)
        inputs = self.inputs.decode(batch)
        greedy = self.inputs.greedy_only(batch)
        if self.graph_runner is not None:
            return PreparedStep(
                batch, SamplingTensors.of(inputs), inputs=inputs, greedy_only=greedy
            )
        sampling = SamplingTensors.of(inputs, greedy_only=greedy)
        return PreparedStep(batch, sampling, context=self.inputs.context(inputs))

    @torch.inference_mode()
    def execute(
        self,
        prepared: PreparedStep,
        keep_logits: bool = False,
        on_staged: Callable[[], None] | None = None,
    ) -> StepOutput:
        """Run a prepared step; ``on_staged`` is called once its inputs are staged, just before
        the model runs (the overlap loop starts its host work there)."""
        timed = self.history is not None and self.device.type == "cpu" and prepared.batch.is_decode
        if not timed:
            return self._execute(prepared, keep_logits, on_staged)
        # A CPU step is synchronous: its wall time is the step's time.
        replays = self.graph_runner.replays if self.graph_runner else 0
        t0 = time.perf_counter()
        out = self._execute(prepared, keep_logits, on_staged)
        elapsed = time.perf_counter() - t0
        n = len(prepared.batch.chunks)
        if n <= self.buckets[-1]:  # split batches are left out: no bucket's figure
            now = self.graph_runner.replays if self.graph_runner else 0
            path = self.backend if now > replays else "eager"
            bucket = pick_bucket(self.buckets, n)
            assert bucket is not None and self.history is not None
            self.history.record_step(path, bucket, elapsed)
        return out

    def _execute(
        self, prepared: PreparedStep, keep_logits: bool, on_staged: Callable[[], None] | None
    ) -> StepOutput:
        if prepared.inputs is not None:
            assert self.graph_runner is not None
            if self.graph_runner.replays_eagerly(prepared.inputs):
                # ``auto`` left this key uncaptured: the plain eager step, whose sampling may
                # take the all-greedy fast path a captured step cannot.
                self.graph_runner.count_uncaptured()
                inputs = prepared.inputs
                sampling = SamplingTensors.of(inputs, greedy_only=prepared.greedy_only)
                ctx = self.inputs.context(inputs)
                if on_staged is not None:
                    on_staged()
                return self.step(ctx, sampling, keep_logits)
            drop = () if keep_logits else ("logits",)
            out: StepOutput = self.graph_runner.run(prepared.inputs, on_staged, drop)
            if not keep_logits:
                out.logits = None  # an eager fallback kept them
            return out
        assert prepared.context is not None
        if on_staged is not None:
            on_staged()
        return self.step(prepared.context, prepared.sampling, keep_logits)

    # -- auto: what a job captures ---------------------------------------------------------------
    def attach_history(self, history: StepHistory, defaults: Estimates) -> None:
        """Measure decode steps into ``history``; ``auto`` plans from it over ``defaults``."""
        self.history = history
        self.defaults = defaults

    def estimates(self) -> Estimates:
        defaults = self.defaults or Estimates()
        if self.history is None:
            return defaults
        return self.history.estimates(self.backend, defaults)

    @property
    def wants_plan(self) -> bool:
        """``auto`` and the next decode step starts a job (read by the pipeline every step)."""
        return self.auto and self._plan_due

    def plan_job(self, outlook: Sequence[Outlook], mode: tuple[int, int]) -> None:
        """``auto``, at the first decode step of a job: capture the artifacts worth it.

        ``outlook`` is every queued and running request; ``mode`` the sampling mode flags of
        the step (artifacts of another mode are not planned: their steps run eagerly). Runs
        once per job (``job_done`` starts the next); a no-op for explicit backends."""
        if not self.auto or not self._plan_due or self.graph_runner is None:
            return
        self._plan_due = False
        runner = self.graph_runner
        counts = simulate(
            outlook,
            max_running=self.max_requests,
            batch_buckets=runner.buckets,
            kv_bucket=runner.kv_bucket,
        )
        have = {(b, kv) for b, kv in counts if runner.has_artifact(ArtifactKey(b, kv, *mode))}
        plan = choose(counts, self.estimates(), have=have)
        keys = [ArtifactKey(b, kv, *mode) for b, kv in plan.captured if (b, kv) not in have]
        if keys and self.before_capture is not None:
            self.before_capture(keys)
        t0 = time.perf_counter()
        runner.capture_keys(keys)
        self.auto_capture_s += time.perf_counter() - t0
        if self.history is not None:
            for key in keys:
                self.history.record_capture(
                    self.backend, (key.batch, key.kv_len), runner.capture_times[key]
                )
        self.plan = plan
        log.info("graphs.backend=auto: %s", plan.summary())

    def job_done(self) -> None:
        """The engine went idle: the next decode step starts a new job; keep what was measured."""
        self._plan_due = True
        if self.history is not None:
            self.history.save()

    # -- report ---------------------------------------------------------------------------------
    def graph_stats(self) -> dict[str, int]:
        keys = ("graph_replays", "eager_fallbacks", "recompiles", "uncaptured_steps")
        if self.graph_runner is None:
            return dict.fromkeys(keys, 0)
        st = self.graph_runner.stats()
        return {k: st[k] for k in keys}

    def backend_label(self) -> str:
        """The backend as configured: ``auto`` says what it resolved to."""
        return f"auto ({self.backend} where a job pays for it)" if self.auto else self.backend

    def capture_seconds(self) -> float:
        """Seconds spent capturing (compiling) artifacts so far."""
        return self.graph_runner.capture_seconds if self.graph_runner is not None else 0.0

    def graph_report(self) -> dict[str, object]:
        return self.graph_runner.stats() if self.graph_runner is not None else {}

    def close(self) -> None:
        if self.history is not None:
            self.history.save()
        self.graph_runner = None


def usable_buckets(buckets: list[int], max_requests: int) -> list[int]:
    """The configured batch buckets a step can fill (at most ``max_requests`` rows)."""
    return sorted({b for b in buckets if b <= max_requests}) or [max_requests]


def compile_options(
    graphs: GraphsSection, device: torch.device, cpu_defaults: dict[str, Any]
) -> dict[str, Any]:
    """Inductor options of a compiled step: the config's, over the step kind's CPU defaults."""
    defaults = cpu_defaults if device.type == "cpu" else {}
    return {**defaults, **graphs.compile_options}


def resolve_backend(name: str, device: torch.device) -> Backend:
    """``auto``: CUDA graphs on a GPU, ``torch.compile`` per bucket on CPU."""
    if name == "auto":
        return "cuda_graph" if device.type == "cuda" else "compile"
    if name == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"graphs.backend=cuda_graph needs a CUDA device, got device={device}")
    if name not in ("eager", "compile", "cuda_graph"):
        raise ValueError(f"graphs.backend={name!r}: expected auto, eager, compile or cuda_graph")
    return cast(Backend, name)
