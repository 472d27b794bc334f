"""Requests: their host-side state, the batches the scheduler forms of them, the outputs handed
back, and prompt validation (every error names the request, the value and what was expected;
nothing here touches engine state, so a bad prompt fails alone)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hyloop.cache.lease import Lease
from hyloop.framework.sampling_params import SamplingParams
from hyloop.graphs.ops import row_keys


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
    lease: Lease | None = None  # what it holds of the pools and the tree while it runs
    num_computed: int = 0  # positions whose KV is written
    num_sampled: int = 0  # tokens launched for sampling (ahead of output_ids under lookahead)
    num_cached: int = 0  # prompt tokens served from the cache
    # Position-independent reuse: prompt spans [start, end) whose KV was copied from a donor at
    # admission (ascending); prefill skips them. ``num_reused`` counts their tokens.
    reused_spans: list[tuple[int, int]] = field(default_factory=list)
    num_reused: int = 0
    num_emitted: int = 0  # output tokens handed out so far (``delta`` outputs start here)
    # Multi-channel models: prompt rows [L, C]; prompt_ids / output_ids then hold row keys.
    prompt_rows: torch.Tensor | None = None
    output_rows: list[list[int]] | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

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


@dataclass
class Chunk:
    """``length`` new tokens of ``req`` starting at absolute position ``start``."""

    req: Request
    start: int
    length: int
    track_slot: int = 0  # recurrent slot to publish the state after this chunk into (0: none)
    out_pos: int = -1  # index of the token this chunk samples; -1: len(req.output_ids)

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length >= len(self.req.prompt_ids)


@dataclass
class Batch:
    chunks: list[Chunk]
    is_decode: bool
    planned: bool = False  # lookahead: its input ids come from the previous step's output

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


def token_prompt(
    request_id: str, prompt: Any, tokenizer: Any, vocab_size: int, max_context: int
) -> list[int]:
    """The prompt's token ids, or a ValueError naming ``request_id`` and what is wrong."""
    where = f"request {request_id!r}"
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"{where}: a text prompt needs a tokenizer, and this checkpoint has none; "
                "pass token ids"
            )
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list | tuple):
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}: prompt token ids must be ints")
    else:
        raise ValueError(
            f"{where}: prompt must be a str or a list of token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError(f"{where}: empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} outside the vocab [0, {vocab_size})")
    _check_room(where, len(ids), "tokens", max_context)
    return ids


def row_prompt(
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    channel_vocab_sizes: list[int],
    max_context: int,
    end_id: int,
) -> tuple[torch.Tensor, list[int]]:
    """Multi-channel prompt rows ``[L, C]`` and their radix keys (the op that keys generated
    rows, run here on the host: a row resent in a prompt keeps the key it was generated with)."""
    where = f"request {request_id!r}"
    try:
        rows = torch.as_tensor(prompt, dtype=torch.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: prompt rows must be an int array [L, C] ({e})") from None
    c = len(channel_vocab_sizes)
    if rows.dim() != 2 or rows.shape[1] != c:
        raise ValueError(f"{where}: prompt rows of shape {tuple(rows.shape)}, expected [L, {c}]")
    if rows.shape[0] == 0:
        raise ValueError(f"{where}: empty prompt")
    vocab = torch.tensor(channel_vocab_sizes)
    bad = (rows < 0) | (rows >= vocab)
    if bool(bad.any()):
        r, ch = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{where}: row {r} channel {ch} id {int(rows[r, ch])} outside [0, {int(vocab[ch])})"
        )
    _check_room(where, rows.shape[0], "rows", max_context)
    if params.logprobs is not None:
        raise ValueError(f"{where}: logprobs are not supported for multi-channel rows")
    return rows, row_keys(rows, end_id).tolist()


def _check_room(where: str, n: int, unit: str, max_context: int) -> None:
    if n >= max_context:
        raise ValueError(
            f"{where}: prompt of {n} {unit} reaches the context limit {max_context} "
            "(model.max_context); no room to generate"
        )
