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
        admit: Callable[[Request], bool],
        chunk_limit: Callable[[Request, int], int] | None = None,
    ) -> None:
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.prefill_token_budget = prefill_token_budget
        self._admit = admit  # allocates pools for a request; False when it must wait
        self._chunk_limit = chunk_limit  # optional cap on a chunk (e.g. track boundaries)
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
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._admit(req):
                break  # FIFO: later requests wait behind the head (no starvation)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)

    def next_batch(self) -> Batch | None:
        self._admit_waiting()
        budget = self.prefill_token_budget
        chunks: list[Chunk] = []
        for req in self.running:
            if req.prefill_done or budget <= 0:
                continue
            start = req.num_computed
            length = min(len(req.prompt_ids) - start, self.prefill_chunk, budget)
            if self._chunk_limit is not None:
                length = self._chunk_limit(req, length)
            chunks.append(Chunk(req, start, length))
            budget -= length
        if chunks:
            return Batch(chunks, is_decode=False)
        decode = [Chunk(r, r.total_len - 1, 1) for r in self.running]
        return Batch(decode, is_decode=True) if decode else None
