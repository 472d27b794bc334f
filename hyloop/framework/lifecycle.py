"""Requests from admission to their last output: admit, apply a step's tokens, finish, outputs.

``RequestLifecycle`` owns the live requests, the scheduler that batches them and the memory that
backs them. The step pipeline calls ``commit_progress`` and ``apply`` when it resolves a step;
the engine calls ``add`` and ``abort``. Both happen on one thread at a time: the engine applies
user calls only at step boundaries, and a step's resolve runs on the overlap thread only while
the scheduler thread waits for it.
"""

from __future__ import annotations

from typing import Any

from hyloop.framework.batch import Batch
from hyloop.framework.config import SchedulerSection
from hyloop.framework.request import Request, RequestOutput, Status
from hyloop.framework.request_memory import RequestMemory
from hyloop.framework.scheduler import Scheduler
from hyloop.framework.step_fn import StepOutput
from hyloop.pools import StepFence


class RequestLifecycle:
    def __init__(
        self,
        memory: RequestMemory,
        scheduler: SchedulerSection,
        max_running: int,
        fence: StepFence,
        tokenizer: Any,
    ) -> None:
        self.memory = memory
        self.fence = fence
        self.tokenizer = tokenizer
        self.page_size = memory.page_size
        self.capture_logits = False  # debug: keep the logits of every sampled token
        self.cached_tokens = 0  # prompt tokens served by the cache (written at admission)
        self.reused_tokens = 0  # prompt tokens copied from a donor at a new offset
        self._requests: dict[str, Request] = {}
        self._outputs: list[RequestOutput] = []  # finished outputs not yet handed out
        self.scheduler = Scheduler(
            max_running=max_running,
            prefill_chunk=scheduler.prefill_chunk,
            prefill_token_budget=scheduler.prefill_token_budget,
            admit=self._admit,
            chunk_limit=memory.chunk_limit,
        )

    # -- requests -------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add(self, req: Request) -> None:
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.status is not Status.FINISHED:
            self.finish(req, "abort")  # unknown or finished: a no-op

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._outputs)

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def check_idle(self) -> None:
        """No batch was scheduled: a waiting request that an idle engine cannot admit is fatal."""
        sched = self.scheduler
        if sched.waiting and not sched.running:
            raise RuntimeError(
                f"request {sched.waiting[0].request_id!r} cannot be admitted into an idle engine "
                "(pool too small for it)"
            )

    def _admit(self, req: Request) -> bool | None:
        verdict = self.memory.admit(req, self.scheduler.running)
        if verdict:
            self.cached_tokens += req.num_cached
            self.reused_tokens += req.num_reused
        return verdict

    # -- a resolved step ------------------------------------------------------------------------
    def commit_progress(self, batch: Batch) -> None:
        """Insert what a step computed: track snapshots, and prefill pages (dense models)."""
        mem = self.memory
        for c in batch.chunks:
            req, end = c.req, c.start + c.length
            if req.status is not Status.RUNNING:
                mem.drop_track_slot(c.track_slot)  # a post-stop step: never inserted
            elif c.track_slot:
                mem.commit(req, end, state_slot=c.track_slot)
            elif (
                mem.commit_during_prefill
                and not batch.is_decode
                and end - req.own_from >= self.page_size
            ):
                mem.commit(req, end)
            c.track_slot = 0

    def apply(
        self,
        batch: Batch,
        out: StepOutput,
        next_ids: list[int],
        next_rows: list[list[int]] | None,
    ) -> list[RequestOutput]:
        """Append sampled tokens, run stop checks, finish requests; returns running outputs."""
        outs: list[RequestOutput] = []
        for i, chunk in enumerate(batch.chunks):
            req = chunk.req
            if req.status is not Status.RUNNING:
                continue  # finished or aborted before this step resolved: token discarded
            req.num_computed = chunk.start + chunk.length
            if not batch.is_decode and not chunk.completes_prompt:
                continue
            tok = next_ids[i]
            req.output_ids.append(tok)
            if req.output_rows is not None and next_rows is not None:
                req.output_rows.append(next_rows[i])
            if req.logprobs is not None:
                req.logprobs.append(_logprob_entry(out, i, tok, req.params.logprobs or 0))
            if req.logits is not None and out.logits is not None:
                req.logits.append(out.logits[i].clone())
            if tok in req.stop_ids:
                self.finish(req, "stop")
            elif len(req.output_ids) >= req.max_new:
                self.finish(req, "length")
            elif req.params.output_kind != "final_only":
                outs.append(self.output(req))
        return outs

    def finish(self, req: Request, reason: str) -> None:
        """End ``req``: commit what it computed (unless aborted) and free what it holds. Frees
        wait for any step still in flight (``StepFence``); so does its working state, which such
        a step has advanced past what is committed, so it is never kept as a snapshot then."""
        if req.status is Status.RUNNING:
            self.memory.release(req, commit=reason != "abort", state_current=self.fence.idle)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._outputs.append(self.output(req))
        del self._requests[req.request_id]

    def output(self, req: Request) -> RequestOutput:
        """The request's output so far (``delta``: what is new since its last output). The
        text, decoded once it finishes, is always the whole output's."""
        finished = req.status is Status.FINISHED
        text = None
        if self.tokenizer is not None and finished:
            text = self.tokenizer.decode(req.output_ids)
        start = req.num_emitted if req.params.output_kind == "delta" else 0
        req.num_emitted = len(req.output_ids)
        rows, logprobs = req.output_rows, req.logprobs
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=req.output_ids[start:],
            text=text,
            finished=finished,
            finish_reason=req.finish_reason,
            num_cached_tokens=req.num_cached,
            num_reused_tokens=req.num_reused,
            logprobs=logprobs[start:] if logprobs is not None else None,
            rows=[list(r) for r in rows[start:]] if rows is not None else None,
        )

    # -- ledger ---------------------------------------------------------------------------------
    def check(self, track_held: int) -> None:
        self.memory.check(self.scheduler.running, track_held=track_held)


def _logprob_entry(out: StepOutput, i: int, tok: int, k: int) -> dict[int, float]:
    assert out.chosen_lp is not None
    entry = {tok: float(out.chosen_lp[i])}
    if k > 0:
        assert out.top_lp is not None and out.top_ids is not None
        for lp, tid in zip(out.top_lp[i, :k].tolist(), out.top_ids[i, :k].tolist(), strict=True):
            entry[int(tid)] = float(lp)
    return entry
