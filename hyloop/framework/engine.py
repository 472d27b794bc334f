"""The engine: requests in, a loop over the step pipeline, outputs out (vLLM's ``LLMEngine``
adds what its clients read, ``hyloop.api.engine``).

``Engine`` holds what assembly built and drives one of two loops over the step pipeline
(``pipeline.SyncLoop`` or ``loops.OverlapLoop``). Going from idle to busy it tells the graphs a job
starts (``auto`` plans its captures then), and when it runs dry that the job is done. Threads:
``add_request`` and ``abort_request`` may be called from any thread; one made while ``step()``
runs is applied at the step's end, as if made between the two steps.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING, Any

from hyloop.cache.lease import RequestCache
from hyloop.features.base import RequestContext
from hyloop.framework.config import EngineConfig
from hyloop.framework.faults import ENGINE_FAULTS, fail_all, stop_engine
from hyloop.framework.loops import OverlapLoop
from hyloop.framework.outputs import RequestOutput
from hyloop.framework.pipeline import StepPipeline, SyncLoop
from hyloop.framework.prompts import new_request
from hyloop.framework.requests import Request
from hyloop.framework.sampling_params import NotSupportedError, SamplingParams, fold_seed
from hyloop.framework.scheduler import Scheduler
from hyloop.framework.stats import StepRecorder
from hyloop.framework.step_kinds import StepKind
from hyloop.graphs.capture import Graphs

if TYPE_CHECKING:
    from torch import nn

    from hyloop.framework.assembly import Derived

log = logging.getLogger(__name__)


class Engine:
    """``add_request`` / ``abort_request`` / ``step`` / ``check_invariants``."""

    def __init__(
        self,
        cfg: EngineConfig,
        derived: Derived,
        model: nn.Module,
        tokenizer: Any,
        kind: StepKind,
        graphs: Graphs,
        pipeline: StepPipeline,
        recorder: StepRecorder,
    ) -> None:
        self.cfg = cfg
        self.derived = derived
        self.model = model
        self.tokenizer = tokenizer
        self.kind = kind
        self.graphs = graphs
        self.pipeline = pipeline
        self.scheduler: Scheduler = pipeline.scheduler
        self.recorder = recorder
        if self.scheduler.speculator is not None:  # drafting pauses while it does not pay
            recorder.on_decode = self.scheduler.speculator.timed
        self.vocab_size = derived.vocab_size
        self.max_context = derived.max_context
        self.eos_ids: frozenset[int] = frozenset(derived.eos_token_ids)
        self._context = RequestContext(tokenizer, self.vocab_size, self.eos_ids)
        self._rng = random.Random(cfg.seed)
        self._sync = SyncLoop(pipeline, recorder)
        self._overlap: OverlapLoop | None = None
        self._loop: SyncLoop | OverlapLoop = self._sync
        if cfg.lookahead.enabled_on(kind.device):
            self._loop = self._overlap_loop()
        self.finished = 0
        self.aborted = 0
        self.failed = 0  # finished with finish reason ``error`` (``faults``)
        self.stopped: str | None = None  # why it stopped (a broken invariant), if it did
        self._idle = True  # no job running: the next step starts one
        self._closed = False
        self._lock = threading.Lock()
        self._in_step = False
        self._queued: list[Callable[[], None]] = []  # user calls made during a step
        self._queued_ids: set[str] = set()  # adds queued during the step
        self._queued_aborts: set[str] = set()  # aborts queued during the step
        # ids taken beyond the scheduler's (a front end's: ``hyloop.api.engine``'s fork parents)
        self.reserved_ids: Container[str] = frozenset()

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> None:
        """Queue a request (a prompt in any of vLLM's forms, or rows for a row model). Errors
        name the request; a bad one never reaches the engine."""
        if lora_request is not None:
            raise NotSupportedError(f"request {request_id!r}: lora_request is not supported")
        if self.stopped is not None:
            raise RuntimeError(f"request {request_id!r}: {self.stopped}")
        req = self._new_request(request_id, prompt, sampling_params)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        with self._lock:
            live = request_id in self.scheduler and request_id not in self._queued_aborts
            if live or request_id in self._queued_ids or request_id in self.reserved_ids:
                raise ValueError(f"request {request_id!r}: id already in use")
            # Drawn only once the request is accepted, so a refused one leaves the seed
            # stream of later requests as it was.
            seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(32)
            req.seed64 = fold_seed(seed)  # the whole int, whatever its size
            if self._in_step:
                self._queued_ids.add(request_id)
                self._queued.append(lambda: self.scheduler.add(req))
            else:
                self.scheduler.add(req)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort a request or several (unknown or finished: a no-op); what it holds is freed
        once no launched step may read it."""
        if not isinstance(request_id, str):
            for rid in list(request_id):
                self.abort_request(rid)
            return
        with self._lock:
            if self._in_step:
                self._queued_aborts.add(request_id)
                self._queued_ids.discard(request_id)  # an add queued before it is aborted too
                self._queued.append(lambda: self.scheduler.abort(request_id))
            else:
                self.scheduler.abort(request_id)

    def default_params(self) -> SamplingParams:
        """vLLM's ``SamplingParams()``, under generation_config.json and ``sampling_defaults``."""
        return SamplingParams(**self.derived.sampling_defaults)

    def _new_request(
        self, request_id: str, prompt: Any, sampling_params: SamplingParams | None
    ) -> Request:
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: sampling_params of type "
                f"{type(sampling_params).__name__}; expected a SamplingParams"
            )
        params = sampling_params or self.default_params()
        where = f"request {request_id!r} sampling_params"
        params.validate(where, self.cfg.model.max_logprobs)
        req = new_request(
            request_id,
            prompt,
            params,
            self.tokenizer,
            self.derived,
            self.cache.kv,
            self.eos_ids,
            capture_logits=self.pipeline.capture_logits,
        )
        self.kind.attach(req, self._context, where)
        return req

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            queued = bool(self._queued)
        return queued or self.scheduler.has_work() or self._loop.busy

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs resolved by it (one step late under lookahead)."""
        with self._lock:
            if self._in_step:
                raise RuntimeError("Engine.step: already running on another thread")
            self._in_step = True
        try:
            if self.stopped is not None:  # what was queued as it stopped ends the same way
                fail_all(self.scheduler, self.stopped)
            elif self._idle and self.scheduler.waiting:
                self._idle = False
                self.pipeline.start_job()
            outputs = self.scheduler.take_outputs()
            try:
                outputs += self._loop.step()
            except ENGINE_FAULTS as e:  # nobody's fault: every request ends with it, reported
                self.stopped = stop_engine(self._loop, self.scheduler, e)
            outputs += self.scheduler.take_outputs()
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
                self.aborted += out.outputs[0].finish_reason == "abort"
                self.failed += out.outputs[0].finish_reason == "error"
        if not self.has_unfinished_requests() and not self._idle:
            self._idle = True
            self.pipeline.end_job()
        return outputs

    @property
    def capture_logits(self) -> bool:
        """Debug: keep the logits of every sampled token (set before adding requests)."""
        return self.pipeline.capture_logits

    @capture_logits.setter
    def capture_logits(self, keep: bool) -> None:
        self.pipeline.capture_logits = keep

    @property
    def lookahead_enabled(self) -> bool:
        return self._loop is not self._sync

    def _overlap_loop(self) -> OverlapLoop:
        if self._overlap is None:  # kept when switched off: its thread and counters carry over
            self._overlap = OverlapLoop(self.pipeline, self.recorder, self.cfg.lookahead.min_batch)
        return self._overlap

    def set_lookahead(self, enable: bool) -> None:
        """Switch lookahead on or off between steps (nothing may be launched or planned), so
        one engine can time both loops on the same weights, pools and artifacts."""
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
        self.graphs.close()

    # -- introspection --------------------------------------------------------------------------
    def request(self, request_id: str) -> Request | None:
        return self.scheduler.get(request_id)

    @property
    def cache(self) -> RequestCache:
        """The request side of the cache: ``.tree`` (the UHRC), ``.kv`` (the KV allocator),
        ``.recurrent``, ``.windows`` (sliding-window pages), ``.reuse``."""
        return self.scheduler.cache

    def check_invariants(self) -> None:
        """Ledger: free + pending-free + request-held + tree-held == capacity, for KV pages and
        state slots; tree structure, lock receipts and LRU order consistent; nothing a launched
        step reads is free."""
        self.pipeline.check_unresolved()
        self.scheduler.check(track_held=self.pipeline.held_track_slots())

    def stats(self) -> dict[str, Any]:
        """Step times and counts (with the lookahead loop's once it ran), cache hits, the
        graphs' counters, pool use and the request counts, in one flat dict."""
        sched, cache, kv = self.scheduler, self.scheduler.cache, self.scheduler.cache.kv
        d = self.recorder.as_dict(overlap=self._overlap is not None)
        d.update(cached_tokens=sched.cached_tokens, reused_tokens=sched.reused_tokens)
        selective = cache.reuse.selective if cache.reuse is not None else None
        d["recomputed_tokens"] = selective.recomputed if selective is not None else 0
        d.update(self.graphs.stats())
        free = kv.available_size()
        d.update(kv_free_tokens=free, kv_capacity_tokens=kv.capacity)
        d["kv_full_tokens_used"] = kv.capacity - free
        d["kv_swa_tokens_used"] = cache.windows.used_tokens() if cache.windows is not None else 0
        d["cache_evictable_tokens"] = cache.tree.evictable_size()
        d.update(requests_finished=self.finished, requests_aborted=self.aborted)
        d.update(requests_failed=self.failed, lookahead=self.lookahead_enabled)
        if sched.speculator is not None:
            d.update(sched.speculator.stats(d["decode_steps"], d["decode_tokens"]))
        return {**d, "weight_bytes": self.derived.weight_bytes, "numerics": self.derived.numerics}
