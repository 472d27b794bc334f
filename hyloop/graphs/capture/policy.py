"""What to capture and when: the one capture object an engine and its recipes use.

``Graphs`` wraps a ``BucketRunner`` with its capture policy. Explicit backends (``compile``,
``cuda_graph``) capture a bucket on its first use. ``auto`` plans per job: when the engine goes
from idle to busy it calls ``job_start``, which simulates the job's decode steps
(``auto_plan.simulate``), captures exactly the artifacts whose saving beats their capture cost
and nothing later, so no compile stalls the loop mid-run; every other step runs eagerly. Decode
step times are measured into this machine's ``StepHistory`` (CPU steps are synchronous, so a
step's wall time is its time), and ``job_done`` keeps them for later plans.

``capture``, ``time`` and ``recapture`` are ``hyloop warmup``'s: capture keys ahead of a job,
time an artifact against the eager step, and capture one again as a new process would.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch

from hyloop.graphs.capture.auto_plan import Estimates, Outlook, Plan, choose, simulate
from hyloop.graphs.capture.bucket_runner import BucketRunner
from hyloop.graphs.capture.buckets import ArtifactKey, pick_bucket
from hyloop.graphs.capture.buffer import CaptureBuffer
from hyloop.graphs.capture.history import StepHistory
from hyloop.graphs.step_batch import StepBatch, StepOutput

__all__ = ["Backend", "Graphs", "resolve_backend"]

log = logging.getLogger(__name__)

Backend = Literal["eager", "compile", "cuda_graph"]
STATS = ("graph_replays", "eager_fallbacks", "recompiles", "uncaptured_steps")


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


class Graphs:
    """A runner and its policy; ``auto`` is a planned compile (or cuda_graph) backend."""

    def __init__(
        self,
        runner: BucketRunner,
        *,
        auto: bool,
        max_running: int,
        history: StepHistory | None = None,
        defaults: Estimates | None = None,
    ) -> None:
        self.runner = runner
        self.backend: Backend = runner.backend
        self.auto = auto and runner.backend != "eager"
        self.max_running = max_running
        self.history = history
        self.defaults = defaults or Estimates()
        self.plan: Plan | None = None  # auto: the latest job's plan
        self.auto_capture_s = 0.0  # auto: capture time at jobs' starts
        self._timed = history is not None and runner.device.type == "cpu"

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.runner.buckets

    @property
    def kv_len_buckets(self) -> tuple[int, ...]:
        return self.runner.kv_len_buckets

    @property
    def buffer(self) -> CaptureBuffer:
        return self.runner.buffer

    def label(self) -> str:
        """The backend as configured: ``auto`` says what it resolved to."""
        return f"auto ({self.backend} where a job pays for it)" if self.auto else self.backend

    # -- steps ----------------------------------------------------------------------------------
    def run(self, batch: StepBatch, on_staged: Callable[[], None] | None = None) -> StepOutput:
        """One step through the runner; CPU decode steps are timed into the history."""
        if not (self._timed and batch.is_decode):
            return self.runner.run(batch, on_staged)
        replays = self.runner.replays
        t0 = time.perf_counter()
        out = self.runner.run(batch, on_staged)
        elapsed = time.perf_counter() - t0
        bucket = pick_bucket(self.buckets, len(batch.req_rows))
        if bucket is not None and self.history is not None:  # split batches: no bucket's figure
            path = self.backend if self.runner.replays > replays else "eager"
            self.history.record_step(path, bucket, elapsed)
        return out

    # -- jobs -----------------------------------------------------------------------------------
    def estimates(self) -> Estimates:
        if self.history is None:
            return self.defaults
        return self.history.estimates(self.backend, self.defaults)

    def job_start(self, outlook: Sequence[Outlook], mode: tuple[int, int, int]) -> None:
        """The engine went from idle to busy with ``outlook`` (every queued request): ``auto``
        captures the artifacts worth it for steps of sampling ``mode`` (artifacts of another
        mode are not planned: their steps run eagerly)."""
        if not self.auto:
            return
        runner = self.runner
        counts = simulate(
            outlook,
            max_running=self.max_running,
            batch_buckets=runner.buckets,
            kv_bucket=runner.kv_bucket,
        )
        have = {(b, kv) for b, kv in counts if runner.has_artifact(ArtifactKey(b, kv, *mode))}
        plan = choose(counts, self.estimates(), have=have)
        keys = [ArtifactKey(b, kv, *mode) for b, kv in plan.captured if (b, kv) not in have]
        # a captured decode bucket's verify steps too (speculative decoding), every tokens bucket
        keys += [
            key
            for b, kv in plan.captured
            for t in runner.verify_tokens
            if not runner.has_artifact(key := ArtifactKey(b, kv, *mode, t))
        ]
        t0 = time.perf_counter()
        runner.capture_keys(keys)
        self.auto_capture_s += time.perf_counter() - t0
        self._record_captures(keys)
        self.plan = plan
        log.info("graphs.backend=auto: %s", plan.summary())

    def job_done(self) -> None:
        """The engine went idle: keep what was measured."""
        if self.history is not None:
            self.history.save()

    def _record_captures(self, keys: Sequence[ArtifactKey]) -> None:
        if self.history is not None:
            for key in keys:
                if key.tokens > 1:  # a verify artifact: the plan's capture costs are decode's
                    continue
                seconds = self.runner.capture_times[key]
                self.history.record_capture(self.backend, (key.batch, key.kv_len), seconds)

    # -- warm-up --------------------------------------------------------------------------------
    def capture(self, keys: Sequence[ArtifactKey]) -> None:
        """Capture ``keys`` now (those not captured yet), recording what each took."""
        missing = [k for k in keys if not self.runner.has_artifact(k)]
        self.runner.capture_keys(missing)
        self._record_captures(missing)

    def time(self, key: ArtifactKey, runs: int = 5) -> tuple[list[float], list[float]]:
        """Seconds of ``runs`` replays of ``key``'s artifact (captured first if need be) and of
        ``runs`` eager steps on the same all-padding rows; both go into the history."""
        self.capture([key])
        artifact = self.runner.artifact(key)
        view = artifact.static
        CaptureBuffer.fill_padding(view)
        cuda = self.runner.device.type == "cuda"

        def timed(fn: Callable[[], Any]) -> list[float]:
            out = []
            for _ in range(runs):
                if cuda:
                    torch.cuda.synchronize(self.runner.device)
                t0 = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize(self.runner.device)
                out.append(time.perf_counter() - t0)
            return out

        with torch.inference_mode():
            replays = timed(artifact.replay)
            eager_view = dataclasses.replace(view, pools=self.runner.kind.pools)
            eager = timed(lambda: self.runner.kind.step(eager_view))
        if self.history is not None:
            for seconds in replays:
                self.history.record_step(self.backend, key.batch, seconds)
            for seconds in eager:
                self.history.record_step("eager", key.batch, seconds)
        return replays, eager

    def recapture(self, key: ArtifactKey) -> float:
        """Drop ``key``'s artifact and capture it again after resetting Dynamo, as a new
        process would (inductor's on-disk cache warm); returns the seconds it took."""
        self.runner.drop(key)
        torch._dynamo.reset()
        self.capture([key])
        return self.runner.capture_times[key]

    # -- report ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        st = self.runner.stats()
        return {
            **{k: st[k] for k in STATS},
            "backend": self.backend,
            "backend_config": self.label(),
            "auto_plan": self.plan.summary() if self.plan is not None else None,
            "auto_capture_s": round(self.auto_capture_s, 3),
        }

    def report(self) -> dict[str, Any]:
        """The runner's counters and the artifacts it holds."""
        return self.runner.stats()

    def close(self) -> None:
        self.job_done()
