"""The step pipeline: prepare -> launch -> resolve, over one step kind.

``prepare`` turns a scheduled batch into a ``PreparedStep`` (track slots, sampled-token counters,
device inputs) and gives it a generation of the ``StepFence``; ``plan`` prepares the decode step
that follows a launched one, before its sampled ids exist; ``launch`` binds those ids on device
(from the previous step's output), runs the step and starts the copy of its ids to the host;
``resolve`` waits for that copy, retires the generation (what waited on the step is freed) and
hands the tokens to the request lifecycle. The loops (``SyncLoop``, ``OverlapLoop``) only order
these calls; a step kind (token decode, frame decode) plugs in through ``StepKind``.

Every prepared step stays registered until it is resolved, so the ledger checks can ask what
launched steps still read (``check_unresolved``) and which track slots they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hyloop.framework.batch import Batch, Chunk
from hyloop.framework.lifecycle import RequestLifecycle
from hyloop.framework.model_runner import PreparedStep, StepKind
from hyloop.framework.recorder import StepRecorder, StepTiming
from hyloop.framework.request import RequestOutput, Status
from hyloop.framework.step_fn import StepOutput
from hyloop.graphs.auto_plan import Outlook
from hyloop.pools import PageAllocator, RecurrentPool, SlotRole, StepFence


@dataclass
class Pending:
    """A prepared step until it is resolved: its generation and what it reads."""

    step: PreparedStep
    gen: int
    source_rows: torch.Tensor | None = None  # plan: rows of the previous output; None: all
    reads: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (slots, upto)


@dataclass
class LaunchedStep:
    pending: Pending
    output: StepOutput  # owned tensors (the bucket runner copies replays out)
    host_ids: torch.Tensor | list[int]  # a list once copied (blocking launch)
    host_rows: torch.Tensor | list[list[int]] | None  # multi-channel rows, the same way
    event: Any  # torch.cuda.Event behind the non-blocking host copy, else None
    timing: StepTiming

    @property
    def batch(self) -> Batch:
        return self.pending.step.batch

    @property
    def gen(self) -> int:
        return self.pending.gen


class StepPipeline:
    def __init__(
        self,
        kind: StepKind,
        requests: RequestLifecycle,
        fence: StepFence,
        recorder: StepRecorder,
        kv_allocator: PageAllocator,
        recurrent: RecurrentPool | None,
    ) -> None:
        self.kind = kind
        self.requests = requests
        self.fence = fence
        self.recorder = recorder
        self.kv_allocator = kv_allocator
        self.recurrent = recurrent
        self.device = kind.device
        self._unresolved: dict[int, Pending] = {}

    # -- prepare --------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Admit what fits and pick the next batch (None: nothing to run)."""
        batch = self.requests.scheduler.next_batch()
        if batch is None:
            self.requests.check_idle()
        return batch

    def prepare(self, batch: Batch, source_rows: torch.Tensor | None = None) -> Pending:
        """Host side of a launch: track slots, sampled-token counters, step inputs."""
        memory = self.requests.memory
        # ``auto`` plans a job at its first decode step (the outlook is read before this step
        # counts its tokens); other steps pay nothing for it.
        plans = batch.is_decode and getattr(self.kind, "wants_plan", False)
        outlook = self.outlook() if plans else None
        for c in batch.chunks:
            memory.advance_window(c.req, c.start, c.start + c.length)
            c.track_slot = memory.take_track_slot(c.start + c.length)
            if batch.is_decode or c.completes_prompt:
                if c.out_pos < 0:
                    c.out_pos = c.req.num_sampled
                c.req.num_sampled += 1
        # Taken now: a release clears ``req.slots``.
        reads = [(c.req.slots, c.start + c.length) for c in batch.chunks if c.req.slots is not None]
        step = self.kind.prepare(batch)
        if outlook is not None and step.inputs is not None:
            self.kind.plan_job(outlook, step.inputs.mode)  # type: ignore[attr-defined]
        pending = Pending(step, self.fence.issue(), source_rows, reads)
        self._unresolved[pending.gen] = pending
        return pending

    def outlook(self) -> list[Outlook]:
        """Every running and queued request as a job plan sees it: the columns its next decode
        step reads and the decode steps left in its budget."""
        sched = self.requests.scheduler
        out = [Outlook(r.total_len, r.max_new - r.num_sampled) for r in sched.running]
        out += [Outlook(len(r.prompt_ids) + 1, r.max_new - 1) for r in sched.waiting]
        return out

    def plan(self, after: Batch, min_batch: int) -> Pending | None:
        """The decode step after ``after`` over its requests still alive, its input ids left to
        bind at launch; None to drain (admissions wait, or the running set changed)."""
        sched = self.requests.scheduler
        if sched.waiting and len(sched.running) < sched.max_running:
            return None  # admissions need a prefill step: drain first
        in_batch = {id(c.req) for c in after.chunks}
        if any(id(r) not in in_batch for r in sched.running):
            return None
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
        placeholder = torch.zeros(
            len(chunks), *self.kind.row_shape, dtype=torch.int64, device=self.device
        )
        index = None
        if len(rows) < len(after.chunks):
            index = self.kind.to_device(torch.tensor(rows, dtype=torch.int64))
        return self.prepare(Batch(chunks, is_decode=True, input_ids=placeholder), index)

    # -- launch ---------------------------------------------------------------------------------
    def launch(
        self,
        pending: Pending,
        after: LaunchedStep | None = None,
        on_staged: Any = None,
        blocking: bool = True,
    ) -> LaunchedStep:
        """Run ``pending``; with ``after``, its input ids are ``after``'s sampled ids, gathered
        on device. ``blocking``: copy the ids to the host now, else behind an event."""
        step = pending.step
        if after is not None:
            source = after.output.feedback
            if pending.source_rows is not None:
                source = source.index_select(0, pending.source_rows)
            step.bind_input_ids(source, self.kind.row_shape)
        keep = self.requests.capture_logits
        rec = self.recorder
        timing = rec.launched(step.batch)
        out = self.kind.execute(step, keep, on_staged)
        rec.queued(timing)  # the device-time end mark: before the copy to the host
        if blocking or out.next_ids.device.type != "cuda":
            host_ids: torch.Tensor | list[int] = out.next_ids.tolist()
            rows = out.next_rows.tolist() if out.next_rows is not None else None
            launched = LaunchedStep(pending, out, host_ids, rows, None, timing)
        else:
            host, host_rows, event = _host_copy(out.next_ids, out.next_rows)
            launched = LaunchedStep(pending, out, host, host_rows, event, timing)
        rec.returned(timing)
        return launched

    def abandon(self, pending: Pending) -> None:
        """A prepared step that will never be resolved (its launch raised). Once the device
        has finished everything queued, no launched step reads anything: every generation
        retires, and the step's track slots go back. Call it with no other thread working on
        the pipeline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._unresolved.pop(pending.gen, None)
        for c in pending.step.batch.chunks:
            self.requests.memory.drop_track_slot(c.track_slot)
            c.track_slot = 0
        self.fence.retire(self.fence.issued)

    # -- resolve --------------------------------------------------------------------------------
    def resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for the step's ids, retire its generation, apply its tokens."""
        if launched.event is not None:
            launched.event.synchronize()
        ids = launched.host_ids
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        rows = launched.host_rows
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        # Step ``launched`` has completed: what waited on it is reusable.
        self.fence.retire(launched.gen)
        del self._unresolved[launched.gen]
        batch = launched.batch
        self.requests.commit_progress(batch)
        return self.requests.apply(batch, launched.output, ids, rows)

    # -- checks ---------------------------------------------------------------------------------
    def unresolved(self) -> list[Pending]:
        """Prepared or launched steps not yet resolved, oldest first."""
        return [self._unresolved[g] for g in sorted(self._unresolved)]

    def held_track_slots(self) -> int:
        """Track slots taken by unresolved steps (not yet committed)."""
        return sum(
            1 for p in self._unresolved.values() for c in p.step.batch.chunks if c.track_slot
        )

    def check_unresolved(self) -> None:
        """No page or state slot an unresolved step reads may be on a free list."""
        alloc = self.kv_allocator
        for p in self.unresolved():
            for slots, upto in p.reads:
                pages = (slots[:upto] // alloc.page_size).numpy()
                free = alloc.is_free_page(pages)
                if free.any():
                    page = int(pages[np.argmax(free)])
                    raise AssertionError(f"page {page} is free while step {p.gen} still reads it")
            if self.recurrent is None:
                continue
            for c in p.step.batch.chunks:
                slot = c.req.state_slot
                if slot and self.recurrent.role_of(slot) is SlotRole.FREE:
                    raise AssertionError(f"state slot {slot} is free while step {p.gen} uses it")


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
