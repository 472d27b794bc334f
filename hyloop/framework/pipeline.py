"""The step pipeline: prepare -> launch -> resolve, over one step kind.

``prepare`` turns a scheduled batch into an ``InflightStep`` (the scheduler's host work for it,
then the step kind's ``StepBatch``) and gives it a generation of the ``StepFence``; ``plan``
prepares the decode step that follows a launched one, before its sampled ids exist; ``launch``
binds those ids on device (from the previous step's output), runs the step through the graphs
and starts the copy of its ids to the host; ``resolve`` waits for that copy, retires the
generation (what waited on the step is freed) and hands the tokens to the scheduler. The loops
(``SyncLoop`` here, ``loops.OverlapLoop``) only order these calls.

Every prepared step stays registered until it is resolved, so the ledger checks can ask what
launched steps still read (``check_unresolved``) and which track slots they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyloop.framework.faults import drop_chunk
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.requests import Batch, Chunk, Status
from hyloop.framework.scheduler import Scheduler
from hyloop.framework.stats import StepRecorder, StepTiming
from hyloop.framework.step_kinds import StepKind
from hyloop.graphs.capture import Graphs, Outlook
from hyloop.graphs.step_batch import StepBatch, StepOutput
from hyloop.pools import SlotRole, StepFence


@dataclass
class InflightStep:
    """A step from its preparation until it is resolved."""

    batch: Batch
    step: StepBatch
    gen: int  # its StepFence generation
    source_rows: torch.Tensor | None = None  # plan: rows of the previous output; None: all
    reads: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (KV slots, upto)
    # Set at launch:
    output: StepOutput | None = None  # owned tensors (the runner copies replays out)
    host_ids: torch.Tensor | list[int] | None = None  # a list once copied (blocking launch)
    host_rows: torch.Tensor | list[list[int]] | None = None  # multi-channel rows, the same way
    event: Any = None  # torch.cuda.Event behind the non-blocking host copy, else None
    timing: StepTiming | None = None


class StepPipeline:
    def __init__(
        self,
        kind: StepKind,
        graphs: Graphs,
        scheduler: Scheduler,
        fence: StepFence,
        recorder: StepRecorder,
    ) -> None:
        self.kind = kind
        self.graphs = graphs
        self.scheduler = scheduler
        self.fence = fence
        self.recorder = recorder
        self.device = kind.device
        self.capture_logits = False  # debug: keep the logits of every sampled token
        self._unresolved: dict[int, InflightStep] = {}

    # -- jobs -----------------------------------------------------------------------------------
    def start_job(self) -> None:
        """The engine goes from idle to busy: the graphs plan for what is queued."""
        sched = self.scheduler
        first = [*sched.running, *sched.waiting][: sched.max_running]  # its first decode batch
        # each request as the plan sees it: the columns its next decode step reads and the
        # decode steps left in its budget
        outlook = [Outlook(r.total_len, r.max_new - r.num_sampled) for r in sched.running]
        outlook += [Outlook(len(r.prompt_ids) + 1, r.max_new - 1) for r in sched.waiting]
        self.graphs.job_start(outlook, self.kind.mode(first))
        self.recorder.note_captures()  # captured before any step began

    def end_job(self) -> None:
        """The engine ran dry: waiting for new requests is no host time of this loop."""
        self.recorder.pause()
        self.graphs.job_done()

    # -- prepare --------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Admit what fits and pick the next batch (None: nothing to run)."""
        return self.scheduler.next_batch()

    def prepare(
        self, batch: Batch, source: list[int] | None = None, rows: int = 0
    ) -> InflightStep | None:
        """Host side of a launch: the scheduler's bookkeeping, then the step's device inputs.
        A request whose part raises fails and leaves the batch (None: none is left). A plan's
        ``source``: each chunk's row in the previous step's output (of ``rows``)."""
        chunks = list(batch.chunks)
        self.scheduler.prepare(batch)
        for c in list(batch.chunks):
            try:
                self.kind.bind(c)
            except Exception as e:
                drop_chunk(self.scheduler, batch, c, e)
        if not batch.chunks:
            return None
        source_rows = None
        if source is not None:
            alive = {id(c) for c in batch.chunks}
            kept = [r for r, c in zip(source, chunks, strict=True) if id(c) in alive]
            if kept != list(range(rows)):
                source_rows = self.kind.to_device(torch.tensor(kept, dtype=torch.int64))
        # The KV slots the step reads, taken now: a release drops the lease.
        reads = [(c.req.lease.slots, c.start + c.length) for c in batch.chunks if c.req.lease]
        step = self.kind.build(batch, keep_logits=self.capture_logits)
        inflight = InflightStep(batch, step, self.fence.issue(), source_rows, reads)
        self._unresolved[inflight.gen] = inflight
        return inflight

    def plan(self, after: Batch, min_batch: int) -> InflightStep | None:
        """The decode step after ``after`` over its requests still alive, its input ids left to
        bind at launch; None to drain (admissions wait, or the running set changed)."""
        sched = self.scheduler
        if sched.waiting and len(sched.running) < sched.max_running:
            return None  # admissions need a prefill step: drain first
        in_batch = {id(c.req) for c in after.chunks}
        if any(id(r) not in in_batch for r in sched.running):
            return None
        if self.device.type == "cuda" and self.kind.host_fed(sched.running):
            return None  # a CUDA graph cannot wait for rows the host still writes: drain
        rows: list[int] = []
        chunks: list[Chunk] = []
        for i, c in enumerate(after.chunks):
            req = c.req
            if req.status is not Status.RUNNING or req.num_sampled >= req.max_new:
                continue  # finished (known), or the step sampled its last token
            rows.append(i)
            start = len(req.prompt_ids) + req.num_sampled - 1
            chunks.append(Chunk(req, start, 1, out_pos=req.num_sampled))
        if not chunks or len(chunks) < min_batch:
            return None
        windows = sched.cache.windows
        spans = [(c.req.request_id, c.start, c.start + 1) for c in chunks]
        if windows is not None and not windows.room(spans):
            return None  # a window page would wait for an eviction behind the running step
        spec = sched.speculator
        if spec is not None and not spec.skips():
            return None  # drafts follow the newest token: drain, then a verify step
        return self.prepare(Batch(chunks, is_decode=True, planned=True), rows, len(after.chunks))

    # -- launch ---------------------------------------------------------------------------------
    def launch(
        self,
        step: InflightStep,
        after: InflightStep | None = None,
        on_staged: Any = None,
        blocking: bool = True,
    ) -> InflightStep:
        """Run ``step``; with ``after``, its input ids are ``after``'s sampled ids, gathered on
        device. ``blocking``: copy the ids to the host now, else behind an event."""
        if after is not None:
            assert after.output is not None
            source = after.output.feedback
            if step.source_rows is not None:
                source = source.index_select(0, step.source_rows)
            step.step.input_ids = source.view(step.step.input_ids.shape)
            self.kind.run_ahead(step.step)  # its features settle once ``after`` is resolved
        rec = self.recorder
        step.timing = timing = rec.launched(step.batch)
        out = step.output = self.graphs.run(step.step, on_staged)
        rec.queued(timing)  # the device-time end mark: before the copy to the host
        if blocking or out.next_ids.device.type != "cuda":
            step.host_ids = out.next_ids.tolist()
            step.host_rows = out.next_rows.tolist() if out.next_rows is not None else None
        else:
            step.host_ids, step.host_rows, step.event = _host_copy(out.next_ids, out.next_rows)
        rec.returned(timing)
        return step

    def abandon(self, step: InflightStep) -> None:
        """A prepared step that will never be resolved (its launch raised). Once the device
        has finished everything queued, no launched step reads anything: every generation
        retires, and the step's track slots go back. Call it with no other thread working on
        the pipeline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._unresolved.pop(step.gen, None)
        self.kind.settle()
        self.scheduler.abandon(step.batch)
        self.fence.retire(self.fence.issued)

    # -- resolve --------------------------------------------------------------------------------
    def resolve(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for the step's ids, retire its generation, apply its tokens."""
        if step.event is not None:
            step.event.synchronize()
        ids, rows = step.host_ids, step.host_rows
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        # The step has completed: what waited on it is reusable.
        self.fence.retire(step.gen)
        del self._unresolved[step.gen]
        assert step.output is not None and ids is not None
        batch, spec = step.batch, self.scheduler.speculator
        if batch.verify and spec is not None:  # what each row's verified positions kept
            spec.accept(batch.chunks, step.output.accepted)
        try:  # first the features' rows a step launched ahead may be waiting for
            for i, c in enumerate(batch.chunks):
                try:
                    for tok in ids[i][: c.taken] if batch.verify else (ids[i],):
                        self.kind.advance(batch, i, tok)
                except Exception as e:
                    self.scheduler.fail(c.req, e)
        finally:
            self.kind.settle()
        outputs = self.scheduler.resolve(batch, step.output, ids, rows)
        if batch.verify and spec is not None:
            spec.settle(batch.chunks)
        return outputs

    # -- checks ---------------------------------------------------------------------------------
    def unresolved(self) -> list[InflightStep]:
        """Prepared or launched steps not yet resolved, oldest first."""
        return [self._unresolved[g] for g in sorted(self._unresolved)]

    def held_track_slots(self) -> int:
        """Track slots taken by unresolved steps (not yet committed)."""
        return sum(1 for p in self._unresolved.values() for c in p.batch.chunks if c.track_slot)

    def check_unresolved(self) -> None:
        """No page or state slot an unresolved step reads may be on a free list."""
        alloc = self.scheduler.cache.kv
        recurrent = self.scheduler.cache.recurrent
        for p in self.unresolved():
            for slots, upto in p.reads:
                pages = (slots[:upto] // alloc.page_size).numpy()
                free = alloc.is_free_page(pages)
                if free.any():
                    page = int(pages[np.argmax(free)])
                    raise AssertionError(f"page {page} is free while step {p.gen} still reads it")
            if recurrent is None:
                continue
            for c in p.batch.chunks:
                slot = c.req.lease.state_slot if c.req.lease is not None else 0
                if slot and recurrent.role_of(slot) is SlotRole.FREE:
                    raise AssertionError(f"state slot {slot} is free while step {p.gen} uses it")


def run_blocking(
    pipeline: StepPipeline, recorder: StepRecorder, batch: Batch, since: float
) -> list[RequestOutput]:
    """Prepare, launch and resolve ``batch`` on this thread (its scheduling began at ``since``)."""
    pending = pipeline.prepare(batch)
    if pending is None:  # each of its requests failed while it was prepared
        return []
    try:
        launched = pipeline.launch(pending)
    except BaseException:
        pipeline.abandon(pending)
        raise
    outputs = pipeline.resolve(launched)
    recorder.completed(launched.timing)
    recorder.account(batch, launched.timing, since)
    return outputs


class SyncLoop:
    """One step per call, resolved before it returns: nothing is in flight between calls."""

    def __init__(self, pipeline: StepPipeline, recorder: StepRecorder) -> None:
        self.pipeline = pipeline
        self.recorder = recorder

    @property
    def busy(self) -> bool:
        return False

    def step(self) -> list[RequestOutput]:
        t0 = self.recorder.now()
        batch = self.pipeline.schedule()
        if batch is None:
            return []
        return run_blocking(self.pipeline, self.recorder, batch, t0)

    def reset(self) -> None:
        abandon_all(self.pipeline)

    def close(self) -> None:
        return None


def abandon_all(pipeline: StepPipeline) -> None:
    """After an engine fault (``faults``): every prepared or launched step is given up."""
    for pending in pipeline.unresolved():
        pipeline.abandon(pending)


def _host_copy(
    next_ids: torch.Tensor, next_rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Pinned host copies of a step's ids (and rows) behind one event: resolve waits on the
    event, never on a later step queued behind it."""

    def pinned(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    ids = pinned(next_ids)
    rows = pinned(next_rows) if next_rows is not None else None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(next_ids.device))  # the copy's device: may be cuda:1
    return ids, rows, event
