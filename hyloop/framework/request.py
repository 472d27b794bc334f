"""A request's host-side state and the outputs handed back to callers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hyloop.framework.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int
    logprobs: list[dict[int, float]] | None = None
    # prompt tokens whose KV came from a donor at another offset (not the exact prefix)
    num_reused_tokens: int = 0
    rows: list[list[int]] | None = None  # multi-channel models: the generated rows [C] each


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed32: int
    max_new: int  # max_tokens clipped to the context limit
    stop_ids: frozenset[int]
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    logits: list[torch.Tensor] | None = None  # debug capture (engine.capture_logits)
    finish_reason: str | None = None
    # Pool state.
    req_row: int = -1
    slots: torch.Tensor | None = None  # KV slots for positions 0..len(slots)-1
    own_from: int = 0  # slots[own_from:] are this request's pages; before: the tree's
    num_computed: int = 0  # positions whose KV is written
    num_sampled: int = 0  # tokens launched for sampling (ahead of output_ids under lookahead)
    num_cached: int = 0  # prompt tokens served from the cache
    # Position-independent reuse: prompt spans [start, end) whose KV was copied from a donor at
    # admission (ascending); prefill skips them. ``num_reused`` counts their tokens.
    reused_spans: list[tuple[int, int]] = field(default_factory=list)
    num_reused: int = 0
    num_emitted: int = 0  # output tokens handed out so far (``delta`` outputs start here)
    lock: Any = None  # cache lock receipt
    state_slot: int = 0  # recurrent working slot (hybrid models)
    # Multi-channel models: prompt rows [L, C]; prompt_ids / output_ids then hold row keys.
    prompt_rows: torch.Tensor | None = None
    output_rows: list[list[int]] | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def rows_at(self, start: int, length: int) -> torch.Tensor:
        """Input rows ``[length, C]`` of positions ``start .. start + length - 1``."""
        assert self.prompt_rows is not None and self.output_rows is not None
        n = self.prompt_rows.shape[0]
        parts = []
        if start < n:
            parts.append(self.prompt_rows[start : min(n, start + length)])
        if start + length > n:
            lo = max(0, start - n)
            parts.append(torch.tensor(self.output_rows[lo : start + length - n], dtype=torch.int64))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def next_prefill_span(self) -> tuple[int, int]:
        """``(start, stop)``: the next prompt positions to compute, from ``num_computed`` past
        any reused span up to the next one (or the prompt's end)."""
        start, stop = self.num_computed, len(self.prompt_ids)
        for s, e in self.reused_spans:
            if s <= start < e:
                start = e
            elif start < s:
                stop = s
                break
        return start, stop

    @property
    def prefill_remaining(self) -> int:
        """Prompt positions still to compute (reused spans were written at admission)."""
        left = len(self.prompt_ids) - self.num_computed
        for s, e in self.reused_spans:
            left -= max(0, e - max(s, self.num_computed))
        return left

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
