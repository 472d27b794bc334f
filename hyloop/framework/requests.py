"""Requests: their host-side state (the batches the scheduler forms of them: ``batches``), the
outputs handed back, and prompt validation (every error names the request, the value and what
was expected; nothing here touches engine state, so a bad prompt fails alone)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hyloop.cache.lease import Lease
from hyloop.framework.batches import Batch, Chunk
from hyloop.framework.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from hyloop.framework.prompts import cache_salt, split_prompt
from hyloop.framework.sampling_params import RequestOutputKind, SamplingParams
from hyloop.framework.step_logprobs import sampled_entry
from hyloop.graphs.ops import row_keys
from hyloop.graphs.step_batch import StepOutput
from hyloop.models.detokenizer import IncrementalText, output_text

# Batch and Chunk live in ``batches``; importers find them here too.
__all__ = ["Batch", "Chunk", "Request", "Status", "new_request", "request_output"]


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


def token_prompt(
    request_id: str,
    prompt: Any,
    tokenizer: Any,
    vocab_size: int,
    max_context: int,
    truncate: int | None = None,
) -> tuple[str | None, list[int]]:
    """``(prompt text, token ids)`` of a prompt in any of vLLM's forms, the ids kept to their
    last ``truncate`` (-1: what the context allows), or a ValueError naming ``request_id``."""
    where = f"request {request_id!r}"
    text, prompt = split_prompt(where, prompt)
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
            f"{where}: prompt must be a str, a list of token ids or a TextPrompt / TokensPrompt "
            f"dict, got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError(f"{where}: empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} outside the vocab [0, {vocab_size})")
    if truncate is not None:
        keep = max_context - 1 if truncate == -1 else truncate
        ids = ids[-keep:]
    _check_room(where, len(ids), "tokens", max_context)
    return text, ids


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
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError(f"{where}: logprobs are not supported for multi-channel rows")
    return rows, row_keys(rows, end_id).tolist()


def new_request(
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    tokenizer: Any,
    derived: Any,
    kv: Any,
    eos_ids: frozenset[int],
    capture_logits: bool = False,
) -> Request:
    """A checked request of an engine (``derived``: what assembly derived; ``kv``: the KV
    allocator), its seed still unset; every error names ``request_id``."""
    d, rows, text = derived, None, None
    if d.row_channels:
        rows, ids = row_prompt(
            request_id, prompt, params, list(d.channel_vocab_sizes), d.max_context, d.end_id
        )
    else:
        text, ids = token_prompt(
            request_id,
            prompt,
            tokenizer,
            d.vocab_size,
            d.max_context,
            params.truncate_prompt_tokens,
        )
    max_new = output_budget(request_id, params, len(ids), d.max_context, kv)
    user_stops = set(params.stop_token_ids or [])
    stop = user_stops if params.ignore_eos else user_stops | eos_ids
    # vLLM's stop_reason: the id that stopped it, None for the tokenizer's own EOS
    primary = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if primary is None and d.eos_token_ids:
        primary = d.eos_token_ids[0]
    return Request(
        request_id=request_id,
        prompt_ids=ids,
        params=params,
        seed64=0,  # set once the engine accepts the id
        max_new=max_new,
        stop_ids=frozenset(stop),
        prompt_text=text,
        arrival_time=time.time(),
        stop_reasons=frozenset(stop if params.ignore_eos else stop - {primary}),
        logprobs=[] if params.logprobs is not None else None,
        prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        logits=[] if capture_logits else None,
        prompt_rows=rows,
        output_rows=[] if rows is not None else None,
        extra_key=cache_salt(f"request {request_id!r}", prompt),
        reads_cache=params.prompt_logprobs is None,
    )


def output_budget(
    request_id: str, params: SamplingParams, prompt_len: int, max_context: int, kv: Any
) -> int:
    """Tokens the request may generate: ``max_tokens`` within the context limit (None: up to
    it, as far as the KV pool holds); a request the pool can never hold is refused."""
    room = max_context - prompt_len
    if params.max_tokens is None:
        max_new = max(1, min(room, kv.capacity - prompt_len))
    else:
        max_new = min(params.max_tokens, room)
    if -(-(prompt_len + max_new) // kv.page_size) > kv.num_pages - 1:  # pages it needs
        raise ValueError(
            f"request {request_id!r}: needs {prompt_len + max_new} KV tokens but the pool holds "
            f"{kv.capacity}; raise kv_pool.num_pages or lower max_tokens"
        )
    return max_new


def _check_room(where: str, n: int, unit: str, max_context: int) -> None:
    if n >= max_context:
        raise ValueError(
            f"{where}: prompt of {n} {unit} reaches the context limit {max_context} "
            "(model.max_context); no room to generate"
        )
