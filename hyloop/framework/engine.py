"""The engine: requests in, a loop over the step pipeline, outputs out.

``Engine`` keeps the requests (``RequestLifecycle``), admission and outputs and drives one of two
loops over one ``StepPipeline``: ``SyncLoop`` or ``OverlapLoop`` (lookahead). The loops see only
the pipeline and the recorder; the engine sees only their public surface (``step``, ``busy``).

Threads: ``add_request`` and ``abort_request`` may be called from any thread. A call made while
``step()`` runs is queued and applied at the step's end, the next step boundary, exactly as if it
had been made between the two steps.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from hyloop.framework.assembly import EngineParts
from hyloop.framework.device_clock import DeviceClock
from hyloop.framework.lifecycle import RequestLifecycle
from hyloop.framework.overlap_loop import OverlapLoop
from hyloop.framework.pipeline import StepPipeline
from hyloop.framework.prompts import row_prompt, token_prompt
from hyloop.framework.recorder import StepRecorder
from hyloop.framework.request import Request, RequestOutput
from hyloop.framework.request_memory import RequestMemory
from hyloop.framework.sampling_params import SamplingParams
from hyloop.framework.swa_windows import SWAWindows
from hyloop.framework.sync_loop import SyncLoop

log = logging.getLogger(__name__)


class Engine:
    """vLLM-shaped engine: ``add_request`` / ``abort_request`` / ``step`` / ``check_invariants``.

    Built from ``framework.assembly.build_parts``; it owns the request lifecycle, the step
    pipeline and its loops.
    """

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.cfg = parts.config
        self.runner = parts.runner
        self.cache = parts.cache
        self.kv_alloc = parts.kv_pool.allocator
        self.tokenizer = parts.tokenizer
        self.vocab_size = parts.vocab_size
        self.max_context = parts.max_context
        self.eos_ids: frozenset[int] = frozenset(parts.eos_token_ids)
        self._rng = random.Random(self.cfg.seed)
        swa_pool = parts.kv_pool.swa
        self.swa_windows = None
        if swa_pool is not None and parts.swa_window is not None:
            chunk = self.cfg.scheduler.prefill_chunk
            self.swa_windows = SWAWindows(swa_pool, parts.swa_window, chunk)
        memory = RequestMemory(
            parts.cache,
            self.kv_alloc,
            parts.req_to_token,
            parts.recurrent_pool,
            self.max_context,
            parts.track_interval,
            parts.pi_reuse,
            self.swa_windows,
        )
        self.requests = RequestLifecycle(
            memory, self.cfg.scheduler, parts.max_running, parts.fence, parts.tokenizer
        )
        self.recorder = StepRecorder(DeviceClock(self.runner.device), self.runner.capture_seconds)
        self.pipeline = StepPipeline(
            self.runner,
            self.requests,
            parts.fence,
            self.recorder,
            self.kv_alloc,
            parts.recurrent_pool,
        )
        self._sync = SyncLoop(self.pipeline, self.recorder)
        self._overlap: OverlapLoop | None = None
        self._loop: SyncLoop | OverlapLoop = self._sync
        if self.cfg.lookahead.enabled_on(self.runner.device):
            self._loop = self._overlap_loop()
        self.finished = 0
        self.aborted = 0
        self._closed = False
        self._lock = threading.Lock()
        self._in_step = False
        self._queued: list[Callable[[], None]] = []  # user calls made during a step
        self._queued_ids: set[str] = set()  # adds queued during the step
        self._queued_aborts: set[str] = set()  # aborts queued during the step

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Any,
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Queue a request. Errors name the request; a bad one never reaches the engine."""
        req = self._new_request(request_id, prompt, sampling_params)
        with self._lock:
            live = request_id in self.requests and request_id not in self._queued_aborts
            if live or request_id in self._queued_ids:
                raise ValueError(f"request {request_id!r}: id already in use")
            # Drawn only once the request is accepted, so a refused one leaves the seed
            # stream of later requests as it was.
            seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(32)
            req.seed32 = seed & 0xFFFFFFFF
            if self._in_step:
                self._queued_ids.add(request_id)
                self._queued.append(lambda: self.requests.add(req))
            else:
                self.requests.add(req)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (unknown or finished: a no-op); what it holds is freed once no
        launched step may read it."""
        with self._lock:
            if self._in_step:
                self._queued_aborts.add(request_id)
                self._queued_ids.discard(request_id)  # an add queued before it is aborted too
                self._queued.append(lambda: self.requests.abort(request_id))
            else:
                self.requests.abort(request_id)

    def default_params(self) -> SamplingParams:
        d = self.cfg.sampling_defaults
        return SamplingParams(
            temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, max_tokens=d.max_tokens
        )

    def validate_prompt(self, request_id: str, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, or a ValueError naming ``request_id`` and what is wrong."""
        return token_prompt(request_id, prompt, self.tokenizer, self.vocab_size, self.max_context)

    def _new_request(
        self, request_id: str, prompt: Any, sampling_params: SamplingParams | None
    ) -> Request:
        params = sampling_params or self.default_params()
        params.validate(f"request {request_id!r} sampling_params")
        parts, rows = self.parts, None
        if parts.row_channels:
            rows, ids = row_prompt(
                request_id,
                prompt,
                params,
                parts.channel_vocab_sizes,
                self.max_context,
                parts.end_id,
            )
        else:
            ids = self.validate_prompt(request_id, prompt)
        max_new = min(params.max_tokens, self.max_context - len(ids))
        if self.kv_alloc.pages_for(len(ids) + max_new) > self.kv_alloc.num_pages - 1:
            raise ValueError(
                f"request {request_id!r}: needs {len(ids) + max_new} KV tokens but the pool holds "
                f"{self.kv_alloc.capacity}; raise kv_pool.num_pages or lower max_tokens"
            )
        stop = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop |= self.eos_ids
        return Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            seed32=0,  # set by add_request once the id is accepted
            max_new=max_new,
            stop_ids=frozenset(stop),
            logprobs=[] if params.logprobs is not None else None,
            logits=[] if self.requests.capture_logits else None,
            prompt_rows=rows,
            output_rows=[] if rows is not None else None,
        )

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            queued = bool(self._queued)
        return queued or self.requests.has_work() or self._loop.busy

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs resolved by it (one step late under lookahead)."""
        with self._lock:
            if self._in_step:
                raise RuntimeError("Engine.step: already running on another thread")
            self._in_step = True
        try:
            outputs = self.requests.take_outputs()
            outputs += self._loop.step()
            outputs += self.requests.take_outputs()
        finally:
            with self._lock:
                self._in_step = False
                queued, self._queued = self._queued, []
                self._queued_ids.clear()
                self._queued_aborts.clear()
                for call in queued:  # the step boundary: calls made during the step apply now
                    try:
                        call()
                    except Exception:  # checked when made, so not expected: never lose the rest
                        log.exception("a queued request call failed at the step boundary")
        for out in outputs:
            if out.finished:
                self.finished += 1
                self.aborted += out.finish_reason == "abort"
        if not self.has_unfinished_requests():
            self.recorder.pause()  # waiting for new requests is no host time of this loop
            self.runner.job_done()  # auto plans the next job afresh
        return outputs

    @property
    def capture_logits(self) -> bool:
        """Debug: keep the logits of every sampled token (set before adding requests)."""
        return self.requests.capture_logits

    @capture_logits.setter
    def capture_logits(self, keep: bool) -> None:
        self.requests.capture_logits = keep

    @property
    def lookahead_enabled(self) -> bool:
        return self._loop is not self._sync

    def _overlap_loop(self) -> OverlapLoop:
        if self._overlap is None:  # kept when switched off: its thread and counters carry over
            self._overlap = OverlapLoop(self.pipeline, self.recorder, self.cfg.lookahead.min_batch)
        return self._overlap

    def set_lookahead(self, enable: bool) -> None:
        """Switch lookahead on or off between steps; nothing may be launched or planned.

        One engine can then time both loops on the same weights, pools and artifacts."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_lookahead: enable must be a bool, got {enable!r}")
        if self._closed:
            raise RuntimeError("set_lookahead: the engine is closed")
        if enable == self.lookahead_enabled:
            return
        if self._loop.busy:
            raise RuntimeError("set_lookahead: a step is in flight; finish the running requests")
        self._loop = self._overlap_loop() if enable else self._sync

    def close(self) -> None:
        self._closed = True
        if self._overlap is not None:
            self._overlap.close()
        self.runner.close()

    # -- introspection --------------------------------------------------------------------------
    def request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def scheduler(self) -> Any:
        return self.requests.scheduler

    @property
    def memory(self) -> RequestMemory:
        return self.requests.memory

    def check_invariants(self) -> None:
        """Ledger: free + pending-free + request-held + tree-held == capacity, for KV pages and
        state slots; tree structure, lock receipts and LRU order consistent; nothing a launched
        step reads is free."""
        self.pipeline.check_unresolved()
        self.requests.check(track_held=self.pipeline.held_track_slots())

    def stats(self) -> dict[str, Any]:
        d = self.recorder.as_dict(overlap=self._overlap is not None)
        d["cached_tokens"] = self.requests.cached_tokens
        d["reused_tokens"] = self.requests.reused_tokens
        d["requests_finished"] = self.finished
        d["requests_aborted"] = self.aborted
        d.update(self.runner.graph_stats())
        d["backend"] = self.runner.backend
        d["backend_config"] = self.runner.backend_label()
        plan = self.runner.plan
        d["auto_plan"] = plan.summary() if plan is not None else None
        d["auto_capture_s"] = round(self.runner.auto_capture_s, 3)
        d["lookahead"] = self.lookahead_enabled
        d["weight_bytes"] = self.parts.weight_bytes
        d["kv_free_tokens"] = self.kv_alloc.available_size()
        d["kv_capacity_tokens"] = self.kv_alloc.capacity
        d["kv_full_tokens_used"] = self.kv_alloc.capacity - self.kv_alloc.available_size()
        d["kv_swa_tokens_used"] = self.swa_windows.used_tokens() if self.swa_windows else 0
        d["cache_evictable_tokens"] = self.cache.evictable_size()
        return d
