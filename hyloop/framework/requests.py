"""Requests: their host-side state (the batches the scheduler forms of them: ``batches``) and the
outputs handed back, with their text (``IncrementalText``) and logprobs in vLLM's shape; a
checked request is made of a prompt in ``prompts.new_request``."""

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
from hyloop.graphs.step_batch import StepOutput
from hyloop.models.tokenizer import IncrementalText

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
    text_state: IncrementalText | None = None  # its text so far (``output_text``)
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
    output); its text is detokenized incrementally (``output_text``)."""
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


def has_text(req: Request, tokenizer: Any) -> bool:
    """Whether ``req``'s outputs carry text (a tokenizer, ``detokenize``, no channel rows)."""
    return tokenizer is not None and req.params.detokenize and req.output_rows is None


def text_of(req: Request, tokenizer: Any) -> IncrementalText:
    if req.text_state is None:
        req.text_state = IncrementalText.start(tokenizer, req.params)
    return req.text_state


def output_text(req: Request, tokenizer: Any, finished: bool, delta: bool) -> str:
    """``req``'s text for its next output: all of it, or (``delta``) what is new since the last
    one. A running output holds back a partial character, and ``req.text_hold`` characters a
    feature may still cut (the start of a stop string)."""
    if not has_text(req, tokenizer):
        return ""
    p, state = req.params, text_of(req, tokenizer)
    if finished:
        ids = req.output_ids
        if req.finish_reason == "stop" and not isinstance(req.stop_reason, str) and ids:
            # a stop token ended it: vLLM shows that token's text only when asked to
            ids = ids if p.include_stop_str_in_output else ids[:-1]
        state.finish(tokenizer, ids)
        end = len(state.text)
    else:
        state.take(tokenizer, req.output_ids)
        end = max(0, len(state.text) - req.text_hold)
    if not delta:
        return state.text[:end]
    start = req.text_emitted
    req.text_emitted = max(start, end)
    return state.text[start:end]


# -- a resolved step's logprobs in vLLM's shape ---------------------------------------------------
def sampled_entry(
    out: StepOutput, i: int | tuple[int, int], tok: int, k: int
) -> dict[int, Logprob]:
    """The sampled token's ``Logprob`` (its rank among all tokens) and the top ``k``; ``i``:
    its row, or (row, position) of a verify step."""
    assert out.chosen_lp is not None and out.chosen_rank is not None
    entry = {tok: Logprob(float(out.chosen_lp[i]), int(out.chosen_rank[i]))}
    if k > 0:
        assert out.top_lp is not None and out.top_ids is not None
        top = zip(out.top_lp[i][:k].tolist(), out.top_ids[i][:k].tolist(), strict=True)
        for rank, (lp, tid) in enumerate(top, 1):
            entry.setdefault(int(tid), Logprob(float(lp), rank))
    return entry


def prompt_entries(
    out: StepOutput, i: int, chunk: Chunk, k: int | None
) -> list[dict[int, Logprob]]:
    """The chunk's prompt logprobs: at each position, the next prompt token's and the top k."""
    assert out.prompt_lp is not None and out.prompt_rank is not None and k is not None
    assert out.prompt_top_lp is not None and out.prompt_top_ids is not None
    n = min(chunk.length, len(chunk.req.prompt_ids) - chunk.start - 1)
    targets = chunk.req.prompt_ids[chunk.start + 1 : chunk.start + 1 + n]
    lps, ranks = out.prompt_lp[i, :n].tolist(), out.prompt_rank[i, :n].tolist()
    top_lp, top_ids = out.prompt_top_lp[i, :n, :k].tolist(), out.prompt_top_ids[i, :n, :k].tolist()
    entries = []
    for t, tok in enumerate(targets):
        entry = {tok: Logprob(lps[t], ranks[t])}
        for rank, (lp, tid) in enumerate(zip(top_lp[t], top_ids[t], strict=True), 1):
            entry.setdefault(tid, Logprob(lp, rank))
        entries.append(entry)
    return entries
