"""Requests: their host-side state (the batches the scheduler forms of them: ``batches``) and the
outputs handed back; a checked request is made of a prompt in ``prompts.new_request``."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hyloop.cache.lease import Lease
from hyloop.framework.batches import Batch, Chunk
from hyloop.framework.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hyloop.framework.sampling_params import RequestOutputKind, SamplingParams
from hyloop.framework.step_logprobs import sampled_entry
from hyloop.graphs.step_batch import StepOutput
from hyloop.models.detokenizer import IncrementalText, output_text

# Batch and Chunk live in ``batches``; importers find them here too.
__all__ = ["Batch", "Chunk", "Request", "Status", "request_output"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed64: int
    max_new: int  # max_tokens clipped to the context limit
    stop_ids: frozenset[int]
    status: Status = Status.WAITING
    prompt_text: str | None = None  # shown in the outputs (a chat: its rendered template)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # stop token ids that are not EOS: the one that ends the request is its stop_reason
    stop_reasons: frozenset[int] = frozenset()
    stop_reason: int | str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    # prompt_logprobs: None for the first prompt token, then one entry per prompt token; such a
    # request computes its whole prompt (no cache read)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    logits: list[torch.Tensor] | None = None  # debug capture (engine.capture_logits)
    finish_reason: str | None = None
    error: str | None = None  # finish reason ``error``: what failed (``framework.faults``)
    # what each feature it uses keeps of it, by the feature's name (``hyloop.features``)
    features: dict[str, Any] = field(default_factory=dict)
    lease: Lease | None = None  # what it holds of the pools and the tree while it runs
    num_computed: int = 0  # positions whose KV is written
    num_sampled: int = 0  # tokens launched for sampling (ahead of output_ids under lookahead)
    num_cached: int = 0  # prompt tokens served from the cache
    # Position-independent reuse: prompt spans [start, end) whose KV was copied from a donor at
    # admission (ascending); prefill skips them. ``num_reused`` counts their tokens.
    reused_spans: list[tuple[int, int]] = field(default_factory=list)
    num_reused: int = 0
    num_recomputed: int = 0  # of the reused, tokens selective recompute computed again
    extra_key: str | None = None  # its namespace in the radix tree and the donor index
    # (a prompt's ``cache_salt``)
    reads_cache: bool = True  # False: computes its whole prompt (it wants prompt logprobs)
    num_emitted: int = 0  # output tokens handed out so far (``delta`` outputs start here)
    text_emitted: int = 0  # characters of output text handed out so far
    text_hold: int = 0  # trailing characters a running output holds back (a feature may cut)
    text_state: IncrementalText | None = None  # its text so far (``detokenizer``)
    # Multi-channel models: prompt rows [L, C]; prompt_ids / output_ids then hold row keys.
    prompt_rows: torch.Tensor | None = None
    output_rows: list[list[int]] | None = None
    draft: Any = None  # speculative decoding's state of it (``speculative.DraftState``)

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

    def append(self, tok: int, out: StepOutput, at: int | tuple[int, int], row: Any) -> None:
        """``tok`` (sampled at ``at`` of ``out``: a row, or a verify step's (row, position))
        joins the output, with its row, logprobs and (debug) logits."""
        if not self.output_ids:
            self.first_token_time = time.time()
        self.output_ids.append(tok)
        if self.output_rows is not None and row is not None:
            self.output_rows.append(row)
        if self.logprobs is not None:
            self.logprobs.append(sampled_entry(out, at, tok, self.params.logprobs or 0))
        if self.logits is not None and out.logits is not None:
            self.logits.append(out.logits[at].clone())

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


def request_output(req: Request, tokenizer: Any) -> RequestOutput:
    """``req``'s output so far in vLLM's shape (``delta``: only what is new since its last
    output); its text is detokenized incrementally (``detokenizer.output_text``)."""
    p = req.params
    finished = req.status is Status.FINISHED
    delta = p.output_kind is RequestOutputKind.DELTA
    start = req.num_emitted if delta else 0
    req.num_emitted = len(req.output_ids)
    text = output_text(req, tokenizer, finished, delta)
    logprobs, cumulative = req.logprobs, None
    if logprobs is not None:
        cumulative = sum(e[t].logprob for e, t in zip(logprobs, req.output_ids, strict=False))
        logprobs = logprobs[start:]
    prompt_lps = req.prompt_logprobs if (not delta or start == 0) else None
    if tokenizer is not None and p.detokenize:
        for entry in [*(logprobs or []), *(prompt_lps or [])]:
            for tid, lp in (entry or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = tokenizer.decode([tid], skip_special_tokens=False)
    rows = req.output_rows
    sample = CompletionOutput(
        index=0,
        text=text,
        token_ids=req.output_ids[start:],
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        rows=[list(r) for r in rows[start:]] if rows is not None else None,
        error=req.error,
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt_text,
        prompt_token_ids=req.prompt_ids,
        outputs=[sample],
        finished=finished,
        prompt_logprobs=prompt_lps,
        metrics=RequestMetrics(
            req.arrival_time,
            req.first_token_time,
            time.time() if finished else None,
            req.draft.drafted if req.draft is not None else 0,
            req.draft.accepted if req.draft is not None else 0,
        ),
        num_cached_tokens=req.num_cached,
        num_reused_tokens=req.num_reused,
        num_recomputed_tokens=req.num_recomputed,
    )
