"""Async lookahead: launch decode step N+1 before resolving step N.

While step N+1 runs, a lookahead thread resolves step N: it copies the step's outputs out of the
reused buffers, appends tokens, runs stop checks, commits track snapshots and finished sequences
to the UHRC, releases what finished requests held and builds outputs. It then plans step N+2
(which requests continue, their track slots, the step's input tensors), so that the scheduler
thread only binds N+2's input ids (on device, from N+1's output) and launches it.

Ownership, in code:
- Hand-off: the scheduler thread submits ``resolve(N) + plan(N+2)`` and then executes step N+1,
  which touches no pool, tree or request bookkeeping; it joins the lookahead thread before it
  returns from ``step()``. Between two ``step()`` calls the lookahead thread is idle, so user
  calls (``add_request``, ``abort_request``) never race it. The tree and the pools are thus
  mutated by one thread at a time. NOTE: ``commit`` may rewrite a running request's req->token
  row while step N+1 reads it; both the old and the new page of such a position hold the same
  KV, and the old page stays pending-free until N+1 completes, so either read is correct.
- A plan is always launched by the next ``step()``: a request aborted after its plan was made
  rides along (its token is discarded), and what it frees waits on the plan's generation.
- Deferred frees: anything freed while step G is in flight (pages, table rows, state slots, the
  pages the tree drops as duplicates) is parked under generation G and becomes reusable only
  when step G is known complete (``flush_pending(G)`` at the start of ``resolve(G)``).
- One step late: a request that finished at step N rode along in step N+1; that token is
  discarded, never returned, never inserted into the tree. Its recurrent state was advanced by
  N+1, so it is never committed as a snapshot (track slots published at boundaries are).
- Outputs of a step are owned copies (the bucket runner clones them; on CUDA they are copied to
  pinned host memory behind an event), so a later replay cannot overwrite them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hyloop.framework.batch import Batch, Chunk
from hyloop.framework.device_clock import StepMarks
from hyloop.framework.request import RequestOutput, Status

if TYPE_CHECKING:
    from hyloop.framework.engine import Engine


@dataclass
class Plan:
    """A decode step prepared ahead: everything but its input ids, bound at launch."""

    gen: int
    batch: Batch
    rows: torch.Tensor | None  # row of each chunk in the previous step's output; None: all
    prepared: Any
    reads: list[tuple[torch.Tensor, int]]  # taken at planning: a release clears req.slots


@dataclass
class Inflight:
    gen: int
    batch: Batch
    result: Any  # StepOutput with owned tensors
    host_ids: torch.Tensor  # next ids on the host (pinned on CUDA)
    event: Any  # torch.cuda.Event on CUDA, else None
    marks: StepMarks | None  # device-time events (CUDA)
    reads: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (slots, upto)


class Lookahead:
    def __init__(self, engine: Engine, min_batch: int) -> None:
        self.engine = engine
        self.min_batch = min_batch
        self.inflight: Inflight | None = None
        self.plan: Plan | None = None  # the step after ``inflight``, ready to launch
        self._gen = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyloop-lookahead")
        self.hidden_host_s = 0.0  # resolve time overlapped with a running step
        self.exposed_wait_s = 0.0  # time the scheduler thread waited for a resolve

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def defer_gen(self) -> int | None:
        """Generation frees must wait for (the last step launched or planned), or None."""
        if self.plan is not None:
            return self.plan.gen
        return self.inflight.gen if self.inflight is not None else None

    def track_held(self) -> int:
        """Track slots taken by the steps in flight and planned (not yet committed)."""
        held = 0
        for batch in (self.inflight and self.inflight.batch, self.plan and self.plan.batch):
            if batch is not None:
                held += sum(1 for c in batch.chunks if c.track_slot)
        return held

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        eng = self.engine
        outputs = eng.take_pending_outputs()
        prev = self.inflight
        if prev is None:
            t0 = time.perf_counter()
            batch = eng.scheduler.next_batch()
            if batch is None:
                eng.check_idle()
                return outputs
            if not batch.is_decode or batch.size < self.min_batch:
                return outputs + eng.run_sync(batch, t0)
            self.inflight = self._launch(batch, t0)
            return outputs
        t0 = time.perf_counter()
        plan, self.plan = self.plan, None
        if plan is None:  # first continuation of a launch, or the thread chose to drain
            plan = self._plan(prev.batch)  # (a user call since may have changed that)
        if plan is None:  # drain: resolve the last step with nothing else in flight
            self.inflight = None
            outputs += self._resolve(prev, defer_gen=None)
            exposed = time.perf_counter() - t0  # planning and resolving, nothing overlapped
            eng.stats_.host_exposed_time += exposed
            if prev.batch.is_decode:
                eng.stats_.decode_time += exposed
                eng.stats_.decode_host_exposed_time += exposed
            return outputs + eng.take_pending_outputs()
        prepared = self._bind_ids(plan, prev)
        futures: list[Future[tuple[list[RequestOutput], Plan | None]]] = []

        stream = _current_stream(self.engine.runner.device)

        def start() -> None:  # the step's inputs are staged: resolve N and plan N+2 meanwhile
            futures.append(self._pool.submit(self._resolve_and_plan, prev, plan, stream))

        self.inflight = self._execute(plan.batch, prepared, plan.gen, t0, plan.reads, start)
        if not futures:
            start()
        t_wait = time.perf_counter()
        resolved, self.plan = futures[0].result()
        outputs += resolved
        wait = time.perf_counter() - t_wait
        self.exposed_wait_s += wait
        eng.stats_.host_exposed_time += wait  # the part of the thread's work not hidden
        eng.stats_.decode_time += wait
        eng.stats_.decode_host_exposed_time += wait
        return outputs + eng.take_pending_outputs()

    def _next_gen(self) -> int:
        self._gen += 1
        return self._gen

    def _plan(self, batch: Batch) -> Plan | None:
        """Prepare the decode step after ``batch`` over its requests still alive, or None to
        drain (admissions are waiting, or the running set changed)."""
        eng = self.engine
        sched = eng.scheduler
        if sched.waiting and len(sched.running) < sched.max_running:
            return None  # admissions need a prefill step: drain first
        in_batch = {id(c.req) for c in batch.chunks}
        if any(id(r) not in in_batch for r in sched.running):
            return None
        rows: list[int] = []
        chunks: list[Chunk] = []
        for i, c in enumerate(batch.chunks):
            req = c.req
            if req.status is not Status.RUNNING or req.num_sampled >= req.max_new:
                continue  # finished (known), or the step sampled its last token
            rows.append(i)
            start = len(req.prompt_ids) + req.num_sampled - 1
            chunks.append(Chunk(req, start, 1, out_pos=req.num_sampled))
        if len(chunks) < self.min_batch:
            return None
        nxt = Batch(chunks, is_decode=True, input_ids=self._placeholder_ids(len(chunks)))
        prepared = eng.prepare_decode(nxt)
        index = None
        if len(rows) < len(batch.chunks):
            index = eng.runner.to_device(torch.tensor(rows, dtype=torch.int64))
        return Plan(self._next_gen(), nxt, index, prepared, _reads(nxt))

    def _placeholder_ids(self, size: int) -> torch.Tensor:
        """Input ids of a planned step until ``_bind_ids`` sets them."""
        runner = self.engine.runner
        return torch.zeros(size, *runner.row_shape, dtype=torch.int64, device=runner.device)

    def _bind_ids(self, plan: Plan, prev: Inflight) -> Any:
        """The plan's input ids, gathered on device from step ``prev``'s output."""
        res = prev.result
        source = res.next_rows if res.next_rows is not None else res.next_ids
        ids = source if plan.rows is None else source.index_select(0, plan.rows)  # on device
        plan.batch.input_ids = ids
        return self.engine.runner.bind_input_ids(plan.prepared, ids)

    def _resolve_and_plan(
        self, prev: Inflight, running: Plan, stream: Any
    ) -> tuple[list[RequestOutput], Plan | None]:
        """Lookahead thread: resolve ``prev`` while ``running`` executes, then plan the next.

        On CUDA it works on the scheduler thread's stream (current streams are per thread), so
        the planned inputs are ordered after the step they follow."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            return self._resolve_and_plan_on(prev, running)

    def _resolve_and_plan_on(
        self, prev: Inflight, running: Plan
    ) -> tuple[list[RequestOutput], Plan | None]:
        outs = self._resolve(prev, running.gen)
        t0 = time.perf_counter()
        plan = self._plan(running.batch)
        self.hidden_host_s += time.perf_counter() - t0
        return outs, plan

    def _launch(self, batch: Batch, t0: float) -> Inflight:
        gen = self._next_gen()
        prepared = self.engine.prepare_decode(batch)
        return self._execute(batch, prepared, gen, t0)

    def _execute(
        self,
        batch: Batch,
        prepared: Any,
        gen: int,
        t0: float,
        reads: list[tuple[torch.Tensor, int]] | None = None,
        on_staged: Callable[[], None] | None = None,
    ) -> Inflight:
        eng = self.engine
        reads = _reads(batch) if reads is None else reads
        t_exec = time.perf_counter()
        marks, captured = eng.clock.begin(batch.is_decode), eng.runner.capture_seconds()
        result = eng.runner.execute(prepared, eng.capture_logits, on_staged)
        eng.clock.end(marks, captured=eng.runner.capture_seconds() > captured)
        host_ids, event = _host_copy(result.next_ids)
        dt_exec = time.perf_counter() - t_exec  # on CUDA the launch only: see ``DeviceClock``
        eng.account(batch, time.perf_counter() - t0, dt_exec)
        return Inflight(gen, batch, result, host_ids, event, marks, reads)

    # -- resolve (lookahead thread, or the scheduler thread when draining) -----------------------
    def _resolve(self, prev: Inflight, defer_gen: int | None) -> list[RequestOutput]:
        t0 = time.perf_counter()
        eng = self.engine
        if prev.event is not None:
            prev.event.synchronize()
        eng.clock.book(prev.marks)
        # Step ``prev`` has completed: what waited on it is reusable.
        eng.memory.flush_pending(prev.gen if defer_gen is not None else None)
        deferring = (
            eng.kv_alloc.deferring(defer_gen) if defer_gen is not None else contextlib.nullcontext()
        )
        with deferring:
            next_ids = prev.host_ids.tolist()
            if prev.result.next_rows is not None:
                prev.result.next_rows = prev.result.next_rows.tolist()
            eng.commit_progress(prev.batch)
            outs = eng.process(prev.batch, prev.result, next_ids, defer_gen)
        if defer_gen is not None:
            self.hidden_host_s += time.perf_counter() - t0
        return outs

    # -- checks ---------------------------------------------------------------------------------
    def check_inflight(self) -> None:
        """No page or state slot a launched step reads may be on a free list."""
        prev = self.inflight
        if prev is None:
            return
        self._check_reads(prev.gen, prev.reads)
        if self.plan is not None:
            self._check_reads(self.plan.gen, self.plan.reads)
        pool = self.engine.memory.recurrent
        if pool is not None:
            from hyloop.pools import SlotRole

            for batch in (prev.batch, self.plan and self.plan.batch):
                for c in batch.chunks if batch is not None else ():
                    if c.req.state_slot and pool.role_of(c.req.state_slot) is SlotRole.FREE:
                        raise AssertionError(
                            f"state slot {c.req.state_slot} is free while a launched or "
                            f"planned step uses it"
                        )

    def _check_reads(self, gen: int, reads: list[tuple[torch.Tensor, int]]) -> None:
        alloc = self.engine.kv_alloc
        for slots, upto in reads:
            pages = (slots[:upto] // alloc.page_size).numpy()
            free = alloc.is_free_page(pages)
            if free.any():
                page = int(pages[np.argmax(free)])
                raise AssertionError(f"page {page} is free while step {gen} still reads it")


def _reads(batch: Batch) -> list[tuple[torch.Tensor, int]]:
    """What a decode step reads of each request's req->token row: its slots up to the new one."""
    return [(c.req.slots, c.start + 1) for c in batch.chunks]


def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _host_copy(next_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if next_ids.device.type != "cuda":
        return next_ids, None
    host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
    host.copy_(next_ids, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(next_ids.device))  # the copy's device: may be cuda:1
    return host, event
