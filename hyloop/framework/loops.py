"""The overlapped loop over the step pipeline, which only orders its calls (the plain one,
``pipeline.SyncLoop``, schedules, launches and resolves each step on the calling thread).

``OverlapLoop``: launch decode step N+1 before resolving step N.

While step N+1 runs, a resolve thread resolves step N (copies its ids out, appends tokens, runs
stop checks, commits track snapshots and finished sequences to the UHRC, frees what finished
requests held, builds outputs) and then plans step N+2, so that the scheduler thread only binds
N+2's input ids (on device, from N+1's output) and launches it.

Ownership, in code:
- Hand-off: the scheduler thread submits ``resolve(N) + plan(N+2)`` and then executes step N+1,
  which touches no pool, tree or request bookkeeping; it joins the resolve thread before
  ``step()`` returns. Between two ``step()`` calls that thread is idle, and the engine applies
  user calls only there, so the tree and the pools are mutated by one thread at a time.
  NOTE: ``commit`` may rewrite a running request's req->token row while step N+1 reads it; both
  the old and the new page of such a position hold the same KV, and the old page stays
  pending-free until N+1 completes, so either read is correct.
- A plan is always launched by the next ``step()``: a request aborted after its plan was made
  rides along (its token is discarded), and what it frees waits on the plan's generation.
- Deferred frees follow the pools' ``StepFence``: whatever is freed while a step's generation is
  unretired waits for it; ``resolve(N)`` retires N first.
- One step late: a request that finished at step N rode along in step N+1; that token is
  discarded, never returned, never inserted into the tree. Its recurrent state was advanced by
  N+1, so it is never committed as a snapshot (track slots published at boundaries are). The
  rule is the fence's: a finishing request's state is committed only when no step is
  unretired, as on a drain or a step run synchronously (prefill, batches under ``min_batch``).
- Outputs of a step are owned copies (the bucket runner clones them; on CUDA the ids are copied
  to pinned host memory behind an event), so a later replay cannot overwrite them.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hyloop.framework.outputs import RequestOutput
from hyloop.framework.pipeline import (
    InflightStep,
    StepPipeline,
    SyncLoop,
    abandon_all,
    run_blocking,
)
from hyloop.framework.stats import StepRecorder

__all__ = ["OverlapLoop", "SyncLoop"]


Resolved = tuple[list[RequestOutput], InflightStep | None]


class OverlapLoop:
    def __init__(self, pipeline: StepPipeline, recorder: StepRecorder, min_batch: int) -> None:
        self.pipeline = pipeline
        self.recorder = recorder
        self.min_batch = min_batch
        self._inflight: InflightStep | None = None
        self._plan: InflightStep | None = None  # the step after ``_inflight``, ready to launch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyloop-resolve")

    @property
    def busy(self) -> bool:
        """A step is launched or planned: the loop cannot be switched off now."""
        return self._inflight is not None or self._plan is not None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def reset(self) -> None:
        """After an engine fault: nothing is in flight or planned any more."""
        self._inflight = self._plan = None
        abandon_all(self.pipeline)

    def step(self) -> list[RequestOutput]:
        pipe, rec = self.pipeline, self.recorder
        t0 = rec.now()
        prev = self._inflight
        if prev is None:
            batch = pipe.schedule()
            if batch is None:
                return []
            if not batch.is_decode or batch.verify or len(batch.chunks) < self.min_batch:
                return run_blocking(pipe, rec, batch, t0)
            first = pipe.prepare(batch)
            if first is None:  # each of its requests failed while it was prepared
                return []
            try:
                self._inflight = pipe.launch(first, blocking=False)
            except BaseException:
                pipe.abandon(first)
                raise
            rec.account(batch, self._inflight.timing, t0)
            return []
        plan, self._plan = self._plan, None
        if plan is None:  # first continuation of a launch, or the thread chose to drain
            plan = pipe.plan(prev.batch, self.min_batch)  # (a user call may have changed that)
        if plan is None:  # drain: resolve the last step with nothing else in flight
            self._inflight = None
            outputs = pipe.resolve(prev)
            rec.completed(prev.timing)
            rec.exposed(rec.now() - t0, prev.batch.is_decode)
            return outputs
        futures: list[Future[Resolved]] = []
        stream = torch.cuda.current_stream(pipe.device) if pipe.device.type == "cuda" else None

        def start() -> None:  # the step's inputs are staged: resolve N and plan N+2 meanwhile
            futures.append(self._pool.submit(self._resolve_and_plan, prev, plan, stream))

        try:
            launched = pipe.launch(plan, after=prev, on_staged=start, blocking=False)
        except BaseException:
            self._recover(prev, futures)
            raise
        self._inflight = launched
        rec.account(plan.batch, launched.timing, t0)
        if not futures:
            start()
        t_wait = rec.now()
        outputs, self._plan = futures[0].result()
        rec.exposed(rec.now() - t_wait, decode=True, waited=True)
        rec.completed(prev.timing)
        return outputs

    def _recover(self, prev: InflightStep, futures: list[Future[Resolved]]) -> None:
        """Launching the planned step raised: finish ``prev`` (on the resolve thread if it started)
        and drop what was planned, so the next ``step()`` starts with nothing in flight. The
        resolved tokens stay applied; finished outputs come with the next step."""
        self._inflight = self._plan = None
        if futures:
            with contextlib.suppress(BaseException):
                futures[0].result()
        else:
            self.pipeline.resolve(prev)
        self.recorder.completed(prev.timing)
        for pending in self.pipeline.unresolved():  # ``failed``, and whatever was planned
            self.pipeline.abandon(pending)

    def _resolve_and_plan(
        self, prev: InflightStep, running: InflightStep, stream: object
    ) -> Resolved:
        """Resolve thread: resolve ``prev`` while ``running`` executes, then plan the next.

        On CUDA it works on the scheduler thread's stream (current streams are per thread), so
        the planned inputs are ordered after the step they follow."""
        t0 = self.recorder.now()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:  # type: ignore[attr-defined]
            outputs = self.pipeline.resolve(prev)
            plan = self.pipeline.plan(running.batch, self.min_batch)
        self.recorder.hidden(self.recorder.now() - t0)
        return outputs, plan
