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

``StepHistory``: ``$HYLOOP_CACHE_DIR/steps/<key>.json`` (the key: machine, model file, dtype,
device, the step's configuration) holds, per backend, the median decode-step time of each batch
bucket seen in the latest run that measured it, and the capture (compile) times of each
artifact key (the first from nothing, later ones with inductor's on-disk cache warm). Files are
written atomically; an unreadable one is treated as empty.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hyloop.graphs.capture.auto_plan import Estimates, Outlook, Plan, choose, key_label, simulate
from hyloop.graphs.capture.backends import Backend
from hyloop.graphs.capture.bucket_runner import BucketRunner
from hyloop.graphs.capture.buckets import ArtifactKey, pick_bucket
from hyloop.graphs.capture.buffer import CaptureBuffer
from hyloop.graphs.step_batch import StepBatch, StepOutput

__all__ = ["Graphs", "StepHistory", "history_key"]

log = logging.getLogger(__name__)

STATS = ("graph_replays", "eager_fallbacks", "recompiles", "uncaptured_steps")


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


MIN_SAMPLES = 3  # steps of one bucket before its median replaces the kept figure
KEEP_CAPTURES = 4  # per artifact key: the first (cold) and the latest warm ones


def history_key(*parts: object) -> str:
    return hashlib.blake2b("\n".join(map(str, parts)).encode(), digest_size=10).hexdigest()


class StepHistory:
    """Measured figures of one model on this machine; ``record_*`` in a run, ``save`` after."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.step_ms: dict[str, dict[int, float]] = defaultdict(dict)  # backend -> bucket -> ms
        # backend -> artifact key label -> seconds, oldest first
        self.capture_s: dict[str, dict[str, list[float]]] = defaultdict(dict)
        self._samples: dict[tuple[str, int], list[float]] = defaultdict(list)
        self._dirty = False
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            for backend, by_bucket in data.get("step_ms", {}).items():
                self.step_ms[backend] = {int(b): float(ms) for b, ms in by_bucket.items()}
            for backend, by_key in data.get("capture_s", {}).items():
                self.capture_s[backend] = {
                    str(k): [float(t) for t in times] for k, times in by_key.items()
                }
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("hyloop: ignoring unreadable step history %s (%s)", self.path, e)

    # -- record ---------------------------------------------------------------------------------
    def record_step(self, backend: str, bucket: int, seconds: float) -> None:
        self._samples[(backend, bucket)].append(seconds * 1e3)

    def record_capture(self, backend: str, key: tuple[int, int], seconds: float) -> None:
        times = self.capture_s[backend].setdefault(key_label(key), [])
        times.append(round(seconds, 3))
        if len(times) > KEEP_CAPTURES:  # keep the first: the cost from nothing
            del times[1 : len(times) - KEEP_CAPTURES + 1]
        self._dirty = True

    def flush_samples(self) -> None:
        """Fold this run's step samples into the kept medians."""
        for (backend, bucket), ms in self._samples.items():
            if len(ms) >= MIN_SAMPLES:
                self.step_ms[backend][bucket] = round(statistics.median(ms), 3)
                self._dirty = True
        self._samples.clear()

    # -- read -----------------------------------------------------------------------------------
    def estimates(self, backend: str, defaults: Estimates) -> Estimates:
        """A copy of ``defaults`` with this history's figures for the eager and ``backend``
        steps (``defaults`` itself is left as it is)."""
        eager = dict(self.step_ms.get("eager", {}))
        captured = dict(self.step_ms.get(backend, {}))
        captures = {k: list(v) for k, v in self.capture_s.get(backend, {}).items()}
        return dataclasses.replace(
            defaults,
            eager_ms=eager,
            captured_ms=captured,
            captures=captures,
            measured=bool(eager or captured or captures),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_ms": {
                k: {str(b): ms for b, ms in sorted(v.items())} for k, v in self.step_ms.items()
            },
            "capture_s": dict(self.capture_s),
        }

    def save(self) -> None:
        self.flush_samples()
        if not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                json.dump(self.as_dict(), fh, indent=1)
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError as e:  # a read-only cache directory costs the history, nothing else
            log.warning("hyloop: could not keep step history in %s: %s", self.path, e)
