"""The engine loop: requests in, scheduled steps, stop checks, cache updates, outputs out."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from hyloop.framework.batch import Batch
from hyloop.framework.device_clock import DeviceClock
from hyloop.framework.lookahead import Lookahead
from hyloop.framework.request import Request, RequestOutput, Status
from hyloop.framework.request_memory import RequestMemory
from hyloop.framework.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineStats:
    def __init__(self) -> None:
        self.prefill_tokens_computed = 0
        self.cached_tokens = 0
        self.prefill_steps = 0
        self.decode_steps = 0
        self.decode_tokens = 0
        self.prefill_time = 0.0
        self.decode_time = 0.0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.host_exposed_time = 0.0  # step wall time not spent executing the step
        self.decode_host_exposed_time = 0.0  # the same, decode steps only
        self.capture_time = 0.0  # first-use captures/compiles, kept out of the step times
        self.step_exec_time = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class Engine:
    """vLLM-shaped engine: ``add_request`` / ``abort_request`` / ``step`` / ``check_invariants``.

    Built by ``framework.assembly.build_engine``; it owns the scheduler, the model runner, the
    pools and the cache.
    """

    def __init__(self, parts: Any) -> None:
        self.parts = parts
        self.cfg = parts.config
        self.runner = parts.runner
        self.cache = parts.cache
        self.kv_alloc = parts.kv_pool.allocator
        self.req_to_token = parts.req_to_token
        self.tokenizer = parts.tokenizer
        self.vocab_size: int = parts.vocab_size
        self.max_context: int = parts.max_context
        self.eos_ids: frozenset[int] = frozenset(parts.eos_token_ids)
        self.page_size = self.kv_alloc.page_size
        model = parts.model
        self.num_channels: int = model.num_channels if getattr(model, "is_row_model", 0) else 0
        self.stats_ = EngineStats()
        self.capture_logits = False  # debug: keep the logits of every sampled token
        self.stream_text = False  # decode text for unfinished outputs too (costs host time)
        self.step_hooks: list[Callable[[Engine], None]] = []
        self._requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._rng = random.Random(self.cfg.seed)
        self.memory = RequestMemory(
            parts.cache,
            self.kv_alloc,
            parts.req_to_token,
            parts.recurrent_pool,
            self.max_context,
            parts.track_interval,
        )
        self.scheduler = _make_scheduler(self)
        self._capture_seen = 0.0
        la = self.cfg.lookahead
        self.clock = DeviceClock(self.runner.device)
        self._parked: Lookahead | None = None  # switched off by ``set_lookahead``
        self._closed = False
        self.lookahead: Lookahead | None = (
            Lookahead(self, la.min_batch) if la.enabled_on(self.runner.device) else None
        )

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r}: id already in use")
        params = sampling_params or self.default_params()
        params.validate(f"request {request_id!r} sampling_params")
        rows = None
        if self.num_channels:
            rows, ids = self._prompt_rows(request_id, prompt, params)
        else:
            ids = self.validate_prompt(request_id, prompt)
        max_new = min(params.max_tokens, self.max_context - len(ids))
        need_pages = self.kv_alloc.pages_for(len(ids) + max_new)
        if need_pages > self.kv_alloc.num_pages - 1:
            raise ValueError(
                f"request {request_id!r}: needs {len(ids) + max_new} KV tokens but the pool holds "
                f"{self.kv_alloc.capacity}; raise kv_pool.num_pages or lower max_tokens"
            )
        stop = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop |= self.eos_ids
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        req = Request(
            request_id=request_id,
            prompt_ids=ids,
            params=params,
            seed32=seed & 0xFFFFFFFF,
            max_new=max_new,
            stop_ids=frozenset(stop),
            logprobs=[] if params.logprobs is not None else None,
            logits=[] if self.capture_logits else None,
            prompt_rows=rows,
            output_rows=[] if rows is not None else None,
        )
        self._requests[request_id] = req
        self.scheduler.add(req)

    def default_params(self) -> SamplingParams:
        d = self.cfg.sampling_defaults
        return SamplingParams(
            temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, max_tokens=d.max_tokens
        )

    def validate_prompt(self, request_id: str, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids, or a ValueError naming ``request_id`` and what is wrong."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"request {request_id!r}: a text prompt needs a tokenizer, and this "
                    "checkpoint has none; pass token ids"
                )
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"request {request_id!r}: prompt token ids must be ints")
        else:
            raise ValueError(
                f"request {request_id!r}: prompt must be a str or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token id {bad[0]} outside the vocab "
                f"[0, {self.vocab_size})"
            )
        if len(ids) >= self.max_context:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(ids)} tokens reaches the context limit "
                f"{self.max_context} (model.max_context); no room to generate"
            )
        return ids

    def _prompt_rows(
        self, request_id: str, prompt: Any, params: SamplingParams
    ) -> tuple[torch.Tensor, list[int]]:
        """Multi-channel prompt rows ``[L, C]`` and their host-side radix keys."""
        from hyloop.graphs.ops import prompt_row_keys

        where = f"request {request_id!r}"
        try:
            rows = torch.as_tensor(prompt, dtype=torch.int64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: prompt rows must be an int array [L, C] ({e})") from None
        c = self.num_channels
        if rows.dim() != 2 or rows.shape[1] != c:
            raise ValueError(
                f"{where}: prompt rows of shape {tuple(rows.shape)}, expected [L, {c}]"
            )
        if rows.shape[0] == 0:
            raise ValueError(f"{where}: empty prompt")
        vocab = torch.tensor(self.parts.model.channel_vocab_sizes)
        bad = (rows < 0) | (rows >= vocab)
        if bool(bad.any()):
            r, ch = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"{where}: row {r} channel {ch} id {int(rows[r, ch])} outside [0, {int(vocab[ch])})"
            )
        if rows.shape[0] >= self.max_context:
            raise ValueError(
                f"{where}: prompt of {rows.shape[0]} rows reaches the context limit "
                f"{self.max_context} (model.max_context); no room to generate"
            )
        if params.logprobs is not None:
            raise ValueError(f"{where}: logprobs are not supported for multi-channel rows")
        return rows, prompt_row_keys(rows)

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return  # unknown or finished: a no-op
        self._finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        inflight = self.lookahead is not None and self.lookahead.inflight is not None
        return self.scheduler.has_work() or bool(self._pending_outputs) or inflight

    def _admit(self, req: Request) -> bool | None:
        verdict = self.memory.admit(req, self.scheduler.running)
        if verdict:
            self.stats_.cached_tokens += req.num_cached
        return verdict

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs resolved by it (one step late under lookahead)."""
        if self.lookahead is not None:
            outputs = self.lookahead.step()
        else:
            outputs = self.take_pending_outputs()
            t0 = time.perf_counter()
            batch = self.scheduler.next_batch()
            if batch is None:
                self.check_idle()
            else:
                outputs += self.run_sync(batch, t0)
        if not self.has_unfinished_requests():
            self.clock.pause()  # waiting for new requests is no host time of this loop
        for hook in self.step_hooks:
            hook(self)
        return outputs

    def take_pending_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def check_idle(self) -> None:
        if self.scheduler.waiting and not self.scheduler.running:
            head = self.scheduler.waiting[0]
            raise RuntimeError(
                f"request {head.request_id!r} cannot be admitted into an idle engine "
                "(pool too small for it)"
            )

    def run_sync(self, batch: Batch, t0: float) -> list[RequestOutput]:
        """Launch and resolve one step on this thread (``t0``: when its scheduling began)."""
        prepared = self.prepare_decode(batch)
        t_exec = time.perf_counter()
        marks, captured = self.clock.begin(batch.is_decode), self.runner.capture_seconds()
        result = self.runner.execute(prepared, keep_logits=self.capture_logits)
        self.clock.end(marks, captured=self.runner.capture_seconds() > captured)
        next_ids = result.next_ids.tolist()
        if result.next_rows is not None:
            result.next_rows = result.next_rows.tolist()
        dt_exec = time.perf_counter() - t_exec
        self.clock.book(marks)
        self.commit_progress(batch)
        outputs = self.process(batch, result, next_ids, None)
        self.account(batch, time.perf_counter() - t0, dt_exec)
        return outputs + self.take_pending_outputs()

    def prepare_decode(self, batch: Batch) -> Any:
        """Host side of a launch: track slots, sampled-token counters, step inputs."""
        for c in batch.chunks:
            c.track_slot = self.memory.take_track_slot(c.start + c.length)
            if batch.is_decode or c.completes_prompt:
                if c.out_pos < 0:
                    c.out_pos = c.req.num_sampled
                c.req.num_sampled += 1
        return self.runner.prepare(batch)

    def commit_progress(self, batch: Batch) -> None:
        """Insert what this step computed: track snapshots, and prefill pages (dense models)."""
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

    def account(self, batch: Batch, wall: float, exec_time: float) -> None:
        s = self.stats_
        # A bucket's first use captures (compiles) it inside the step: count that apart, so the
        # step times and tok/s describe the replayed loop.
        captured = self.runner.capture_seconds()
        cap, self._capture_seen = captured - self._capture_seen, captured
        s.capture_time += cap
        wall, exec_time = wall - cap, exec_time - cap
        exposed = max(0.0, wall - exec_time)
        s.host_exposed_time += exposed
        s.step_exec_time += exec_time
        if batch.is_decode:
            s.decode_steps += 1
            s.decode_tokens += batch.size
            s.decode_time += wall
            s.decode_host_exposed_time += exposed
        else:
            s.prefill_steps += 1
            s.prefill_tokens_computed += batch.num_tokens
            s.prefill_time += wall

    def process(
        self, batch: Batch, result: Any, next_ids: list[int], defer_gen: int | None
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
            if req.output_rows is not None:
                req.output_rows.append(result.next_rows[i])
            if req.logprobs is not None:
                req.logprobs.append(_logprob_entry(result, i, tok, req.params.logprobs or 0))
            if req.logits is not None and result.logits is not None:
                req.logits.append(result.logits[i].clone())
            reason = None
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.output_ids) >= req.max_new:
                reason = "length"
            if reason is not None:
                self._finish(req, reason, defer_gen)
            elif req.params.output_kind == "cumulative":
                outs.append(self._output(req))
        return outs

    # -- finishing ------------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str, defer_gen: int | None = -1) -> None:
        if defer_gen == -1:  # not from a resolve: defer to whatever step is in flight
            defer_gen = self.lookahead.defer_gen if self.lookahead is not None else None
        if req.status is Status.RUNNING:
            self.memory.release(
                req,
                commit=reason != "abort",
                defer_gen=defer_gen,
                state_current=self.lookahead is None,
            )
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.stats_.requests_finished += 1
        if reason == "abort":
            self.stats_.requests_aborted += 1
        self._pending_outputs.append(self._output(req))
        del self._requests[req.request_id]

    def _output(self, req: Request) -> RequestOutput:
        text = None
        finished = req.status is Status.FINISHED
        if self.tokenizer is not None and (finished or self.stream_text):
            text = self.tokenizer.decode(req.output_ids)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=text,
            finished=req.status is Status.FINISHED,
            finish_reason=req.finish_reason,
            num_cached_tokens=req.num_cached,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            rows=[list(r) for r in req.output_rows] if req.output_rows is not None else None,
        )

    def set_lookahead(self, enable: bool) -> None:
        """Switch lookahead on or off between steps; nothing may be launched or planned.

        One engine can then time both loops on the same weights, pools and artifacts."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_lookahead: enable must be a bool, got {enable!r}")
        if self._closed:
            raise RuntimeError("set_lookahead: the engine is closed")
        la = self.lookahead
        if enable == (la is not None):
            return
        if la is None:  # its thread (and counters) carry over from the last time it was on
            la = self._parked or Lookahead(self, self.cfg.lookahead.min_batch)
            self.lookahead, self._parked = la, None
            return
        if la.inflight is not None or la.plan is not None:
            raise RuntimeError("set_lookahead: a step is in flight; finish the running requests")
        self.lookahead, self._parked = None, la

    def close(self) -> None:
        self._closed = True
        for la in (self.lookahead, self._parked):
            if la is not None:
                la.close()
        self.runner.close()

    # -- introspection --------------------------------------------------------------------------
    def request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def check_invariants(self) -> None:
        """Ledger: free + pending-free + request-held + tree-held == capacity, for KV pages and
        state slots; tree structure, lock receipts and LRU order consistent."""
        track = 0
        if self.lookahead is not None:
            self.lookahead.check_inflight()
            track = self.lookahead.track_held()
        self.memory.check(self.scheduler.running, track_held=track)

    def stats(self) -> dict[str, Any]:
        d = self.stats_.as_dict()
        d.update(self.runner.graph_stats())
        d["weight_bytes"] = self.parts.weight_bytes
        d.update(self.clock.stats())
        la = self.lookahead or self._parked  # a parked one keeps its counters
        if la is not None:
            d["lookahead_hidden_host_s"] = la.hidden_host_s
            d["lookahead_wait_s"] = la.exposed_wait_s
        d["kv_free_tokens"] = self.kv_alloc.available_size()
        d["kv_capacity_tokens"] = self.kv_alloc.capacity
        d["cache_evictable_tokens"] = self.cache.evictable_size()
        return d


def _logprob_entry(result: Any, i: int, tok: int, k: int) -> dict[int, float]:
    entry = {tok: float(result.chosen_lp[i])}
    if k > 0:
        for lp, tid in zip(
            result.top_lp[i, :k].tolist(), result.top_ids[i, :k].tolist(), strict=True
        ):
            entry[int(tid)] = float(lp)
    return entry


def _make_scheduler(engine: Engine) -> Any:
    from hyloop.framework.scheduler import Scheduler

    s = engine.cfg.scheduler
    return Scheduler(
        max_running=min(s.max_running_requests, engine.req_to_token.max_requests),
        prefill_chunk=s.prefill_chunk,
        prefill_token_budget=s.prefill_token_budget,
        admit=engine._admit,
        chunk_limit=engine.memory.chunk_limit,
    )
