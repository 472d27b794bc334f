"""Requests from admission to their last output: continuous batching under the pool budget.

Policy: prefill first (chunks of waiting prompts up to the step's token budget), otherwise one
decode step over every running request. Admission takes a ``Lease`` from the request cache,
which reserves KV pages for the whole request (prompt + max new tokens, less what the cache
serves) and evicts unlocked tree entries when short; a request that does not fit waits in the
queue (backpressure, never a mid-step allocation failure).

The scheduler owns the live requests and their leases and calls down into the request cache;
nothing calls back. The pipeline calls ``next_batch`` and ``prepare`` before a step and
``resolve`` after it; the engine calls ``add`` and ``abort``. Both happen on one thread at a
time: the engine applies user calls only at step boundaries, and a step's resolve runs on the
overlap thread only while the scheduler thread waits for it. A request whose own work raises
fails alone (``fail``); a broken invariant is raised on (``framework.faults``).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import TYPE_CHECKING, Any

from hyloop.cache.lease import RequestCache
from hyloop.framework.config import SchedulerSection
from hyloop.framework.faults import bare_output, describe, drop_chunk, is_engine_fault
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.requests import Batch, Chunk, Request, Status, prompt_entries, request_output
from hyloop.framework.sampling_params import RequestOutputKind
from hyloop.graphs.step_batch import StepOutput
from hyloop.pools import LedgerError, StepFence

if TYPE_CHECKING:
    from hyloop.features.base import Feature
    from hyloop.speculative import Speculator

log = logging.getLogger(__name__)

# A request is held back one step when an admitted, still-prefilling request shares at least this
# many more prompt tokens with it than the cache can serve: it will hit them after the insert.
DEFER_MIN_SHARED = 16


class Scheduler:
    def __init__(
        self,
        cache: RequestCache,
        section: SchedulerSection,
        max_running: int,
        fence: StepFence,
        tokenizer: Any,
        features: list[Feature],
        speculator: Speculator | None = None,
    ) -> None:
        self.cache = cache
        self.speculator = speculator  # drafts for decode steps (``hyloop.speculative``), or None
        self.features = features  # the step kind's (``stop_hit`` of those a request uses)
        self.fence = fence
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.prefill_chunk = section.prefill_chunk
        self.prefill_token_budget = section.prefill_token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cached_tokens = 0  # prompt tokens served by the cache (written at admission)
        self.reused_tokens = 0  # prompt tokens copied from a donor at a new offset
        self._requests: dict[str, Request] = {}
        self._outputs: list[RequestOutput] = []  # finished outputs not yet handed out

    # -- requests -------------------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add(self, req: Request) -> None:
        self._requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.status is not Status.FINISHED:
            self.finish(req, "abort")  # unknown or finished: a no-op

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outputs)

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # -- batches --------------------------------------------------------------------------------
    def _defers(self, req: Request) -> bool:
        """Whether an admitted, still-prefilling request is about to insert a prefix ``req``
        shares (so it would recompute it now and hit it one step later)."""
        cached = self.cache.cached_len(req.prompt_ids[:-1], req.extra_key)
        for other in self.running:
            if not other.prefill_done and other.extra_key == req.extra_key:
                shared = len(os.path.commonprefix([req.prompt_ids[:-1], other.prompt_ids]))
                if shared - cached >= max(DEFER_MIN_SHARED, self.cache.page_size):
                    return True
        return False

    def _admit_waiting(self) -> None:
        """Admit FIFO while there is room, up to one step's prefill budget of pending tokens.

        Admitting lazily (not every waiting request at once) lets later requests match the
        prefixes that earlier ones insert as their chunks complete.
        """
        pending = sum(r.prefill_remaining for r in self.running if not r.prefill_done)
        deferred: list[Request] = []
        while self.waiting and len(self.running) < self.max_running:
            if pending >= self.prefill_token_budget:
                break
            req = self.waiting.popleft()
            if self._defers(req):
                deferred.append(req)
                continue
            try:
                lease = self.cache.admit(req)  # NOTE: on an error it holds nothing
            except Exception as e:
                self.fail(req, e)
                continue
            if lease is None:
                self.waiting.appendleft(req)
                break  # FIFO: later requests wait behind the head (no starvation)
            req.lease = lease
            req.num_cached = req.num_computed = lease.cached
            req.reused_spans, req.num_reused = lease.reused_spans, lease.reused
            self.cached_tokens += lease.cached
            self.reused_tokens += lease.reused
            req.status = Status.RUNNING
            self.running.append(req)
            pending += req.prefill_remaining
        self.waiting.extendleft(reversed(deferred))

    def next_batch(self) -> Batch | None:
        """Admit what fits and pick the next batch (None: nothing to run)."""
        self._admit_waiting()
        budget = self.prefill_token_budget
        chunks: list[Chunk] = []
        for req in self.running:
            if req.prefill_done or budget <= 0:
                continue
            start, stop = req.next_prefill_span()
            req.num_computed = start  # reused spans were written at admission
            limit = min(self.prefill_chunk, budget)
            policy = req.lease.selective if req.lease is not None else None
            spans = req.lease.blend_spans if policy is not None else []
            if policy is None:
                length = min(stop - start, limit)
            else:  # reused tokens mostly stop at the check layer: a longer chunk, same cost
                length = policy.fit(spans, start, stop, limit)
                if chunks and length < policy.fit(spans, start, stop, self.prefill_chunk):
                    continue  # whole in a step with room: its query weighs what it recomputes
            length = self.cache.chunk_limit(start, length)
            chunks.append(Chunk(req, start, length))
            budget -= length if policy is None else policy.cost(spans, start, length)
        if chunks:
            return Batch(chunks, is_decode=False)
        if self.running:  # a decode step, with the speculator's drafts (then it verifies)
            chunks = [Chunk(r, r.total_len - 1, 1) for r in self.running]
            verify = self.speculator is not None and self.speculator.draft(chunks, self.features)
            return Batch(chunks, is_decode=True, verify=verify)
        if self.waiting:  # add_request refuses what can never fit: a broken promise
            raise LedgerError(
                f"request {self.waiting[0].request_id!r} cannot be admitted into an idle engine "
                "(pool too small for it)"
            )
        return None

    def prepare(self, batch: Batch) -> None:
        """Host work before a step: window pages, track slots, sampled-token counters. A
        request whose part raises fails, and its chunk leaves the batch."""
        for c in list(batch.chunks):
            try:
                if c.req.lease is not None:
                    self.cache.advance_window(c.req, c.req.lease, c.start, c.start + c.length)
                c.track_slot = self.cache.take_track_slot(c.start + c.length)
            except Exception as e:
                drop_chunk(self, batch, c, e)
                continue
            if batch.is_decode or c.completes_prompt:
                if c.out_pos < 0:
                    c.out_pos = c.req.num_sampled
                c.req.num_sampled += 1

    def abandon(self, batch: Batch) -> None:
        """A prepared step that will never run: its track slots go back."""
        for c in batch.chunks:
            self.cache.drop_track_slot(c.track_slot)
            c.track_slot = 0

    # -- a resolved step ------------------------------------------------------------------------
    def resolve(
        self, batch: Batch, out: StepOutput, next_ids: list[int], next_rows: list[list[int]] | None
    ) -> list[RequestOutput]:
        """Commit what the step computed, append its tokens, run stop checks, finish requests;
        returns running outputs."""
        self._commit_progress(batch)
        outs: list[RequestOutput] = []
        for i, chunk in enumerate(batch.chunks):
            req = chunk.req
            if req.status is not Status.RUNNING:  # ended before this step resolved: dropped
                chunk.taken = 0 if batch.verify else chunk.taken
                continue
            try:
                got = self._resolve_one(batch, i, out, next_ids, next_rows)
            except Exception as e:
                self.fail(req, e)
                continue
            if got is not None:
                outs.append(got)
        return outs

    def _resolve_one(
        self, batch: Batch, i: int, out: StepOutput, ids: list[int], rows: list[list[int]] | None
    ) -> RequestOutput | None:
        """Row ``i`` of a resolved step: its request's token, logprobs and stop checks; its
        running output when it streams."""
        chunk = batch.chunks[i]
        req = chunk.req
        tokens = [ids[i]] if not batch.verify else ids[i][: chunk.taken]  # type: ignore[index]
        req.num_computed = chunk.start + (chunk.length if not batch.verify else 1)
        if req.prompt_logprobs is not None and not batch.is_decode:
            req.prompt_logprobs += prompt_entries(out, i, chunk, req.params.prompt_logprobs)
        if not batch.is_decode and not chunk.completes_prompt:
            return None
        req.num_sampled += len(tokens) - 1  # the verify step's tokens past its first
        reason: str | None = None
        for j, tok in enumerate(tokens):
            req.num_computed += j > 0  # the accepted draft's KV (a verify step's)
            req.append(tok, out, (i, j) if batch.verify else i, rows[i] if rows else None)
            if len(req.output_ids) >= req.max_new:  # vLLM checks the length first
                reason = "length"
            elif tok in req.stop_ids:
                req.stop_reason, reason = (tok if tok in req.stop_reasons else None), "stop"
            # then the features' stops (stop strings): past a length stop, never a stop token
            for f in self.features if req.features and reason != "stop" else ():
                if f.name in req.features and (hit := f.stop_hit(req, self.tokenizer)) is not None:
                    req.stop_reason, reason = hit, "stop"
                    break
            if reason is not None:
                chunk.taken = j + 1  # (a verify step's tokens after a stop are dropped)
                self.finish(req, reason)
                return None
        if req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
            return self.output(req)
        return None

    def _commit_progress(self, batch: Batch) -> None:
        """Insert what a step computed: track snapshots, and prefill pages (dense models)."""
        cache = self.cache
        for c in batch.chunks:
            req, end, lease = c.req, c.start + c.length, c.req.lease
            if req.status is not Status.RUNNING or lease is None:
                cache.drop_track_slot(c.track_slot)  # a post-stop step: never inserted
            else:
                try:
                    if c.track_slot:
                        cache.commit(req, lease, end, state_slot=c.track_slot)
                    elif (
                        cache.commits_prefill
                        and not batch.is_decode
                        and end - lease.own_from >= cache.page_size
                    ):
                        cache.commit(req, lease, end)
                except Exception as e:
                    cache.drop_track_slot_if_held(c.track_slot)
                    self.fail(req, e)
            c.track_slot = 0

    def finish(self, req: Request, reason: str) -> None:
        """End ``req``: commit what it computed (unless aborted) and free what it holds. Frees
        wait for any step still in flight (``StepFence``); so does its working state, which such
        a step has advanced past what is committed, so it is never kept as a snapshot then."""
        if req.status is Status.RUNNING:
            assert req.lease is not None
            commit = reason not in ("abort", "error")  # a failed request's KV is not trusted
            try:
                self.cache.release(req, req.lease, req.num_computed, commit, self.fence.idle)
            except Exception as e:  # what it held is unaccounted for: nobody's fault but ours
                raise LedgerError(f"request {req.request_id!r}: release failed: {e}") from e
            req.lease = None
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self._outputs.append(self.last_output(req))
        del self._requests[req.request_id]

    def fail(self, req: Request, error: Exception) -> None:
        """``req``'s own work raised ``error``: it ends with finish reason ``error`` and the
        message in its output, holding nothing. A broken invariant is re-raised: it is not
        ``req``'s to carry (``faults``)."""
        if is_engine_fault(error):
            raise error
        if req.status is Status.FINISHED:  # ended already: what raised came after
            return
        log.warning("request %r failed: %s", req.request_id, describe(error), exc_info=error)
        req.error = describe(error)
        self.finish(req, "error")

    def forget(self, req: Request) -> None:
        """``req`` ended without ``finish`` (a broken ledger): its output queued, its id free."""
        self._outputs.append(self.last_output(req))
        self._requests.pop(req.request_id, None)

    def output(self, req: Request) -> RequestOutput:
        """The request's output so far (``delta``: what is new since its last output)."""
        return request_output(req, self.tokenizer)

    def last_output(self, req: Request) -> RequestOutput:
        try:
            return self.output(req)
        except Exception:  # a failed request's text may be what failed: leave it out
            if req.finish_reason != "error":
                raise
            return bare_output(req)

    # -- ledger ---------------------------------------------------------------------------------
    def check(self, track_held: int) -> None:
        leases = {r.request_id: r.lease for r in self.running if r.lease is not None}
        self.cache.check(leases, track_held=track_held)
