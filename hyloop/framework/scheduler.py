"""Continuous batching: admission under the pool budget, chunked prefill, decode batches.

Policy: prefill first (chunks of waiting prompts up to the step's token budget), otherwise one
decode step over every running request. Admission reserves KV pages for the whole request
(prompt + max new tokens, less what the cache serves), evicting unlocked tree entries when the
allocator runs short; a request that does not fit waits in the queue (backpressure, never a
mid-step allocation failure).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hyloop.framework.batch import Batch, Chunk
from hyloop.framework.request import Request, Status


class Scheduler:
    def __init__(
        self,
        max_running: int,
        prefill_chunk: int,
        prefill_token_budget: int,
        admit: Callable[[Request], bool | None],
        chunk_limit: Callable[[Request, int, int], int] | None = None,
    ) -> None:
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.prefill_token_budget = prefill_token_budget
        # Allocates pools for a request: True admitted, False out of resources (stop admitting),
        # None defer (it would recompute a prefix an admitted request is about to insert).
        self._admit = admit
        self._chunk_limit = chunk_limit  # (req, start, length) -> length, e.g. track boundaries
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
            verdict = self._admit(req)
            if verdict is None:
                deferred.append(req)
                continue
            if not verdict:
                self.waiting.appendleft(req)
                break  # FIFO: later requests wait behind the head (no starvation)
            req.status = Status.RUNNING
            self.running.append(req)
            pending += req.prefill_remaining
        self.waiting.extendleft(reversed(deferred))

    def next_batch(self) -> Batch | None:
        self._admit_waiting()
        budget = self.prefill_token_budget
        chunks: list[Chunk] = []
        for req in self.running:
            if req.prefill_done or budget <= 0:
                continue
            start, stop = req.next_prefill_span()
            req.num_computed = start  # reused spans were written at admission
            length = min(stop - start, self.prefill_chunk, budget)
            if self._chunk_limit is not None:
                length = self._chunk_limit(req, start, length)
            chunks.append(Chunk(req, start, length))
            budget -= length
        if chunks:
            return Batch(chunks, is_decode=False)
        decode = [Chunk(r, r.total_len - 1, 1) for r in self.running]
        return Batch(decode, is_decode=True) if decode else None
