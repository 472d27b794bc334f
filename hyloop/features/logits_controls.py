"""vLLM's ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``min_tokens``, in the step.

Each becomes per-request rows the step applies with no host round trip: one additive ``bias``
row (the logit bias, ``-inf`` outside the allowed ids and on single-token bad words), the stop
ids ``min_tokens`` masks with the count it masks them for, and each multi-token bad word as a
right-aligned prefix and the token it bans once the output ends with that prefix (``BAD_WORDS``
words of up to ``BAD_WORD_PREFIX + 1`` tokens; the step keeps each row's last
``BAD_WORD_PREFIX`` output tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hyloop.features.base import (
    FLOAT32_MAX,
    INT32_MAX,
    Feature,
    RequestContext,
    bad,
    is_float32,
    is_integer,
    is_number,
)
from hyloop.graphs.request_table import column

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams
    from hyloop.graphs.step_batch import StepBatch

# Static sizes of the bad-word tables (the step keeps this many recent output tokens per row).
BAD_WORDS = 8
BAD_WORD_PREFIX = 7
ANY_TOKEN = -2  # a prefix position that matches any recent token (a shorter word's left end)


def _of(name: str, empty: Any = None) -> Callable[[Request], Any]:
    """A column's value: the request's row of it (``build_controls``), else ``empty``."""
    return lambda r: r.features.get(LogitsControls.name, {}).get(name, empty)


class LogitsControls(Feature):
    name = "logits_controls"
    fields = {"logit_bias": None, "allowed_token_ids": None, "bad_words": None, "min_tokens": 0}
    flag = "controlled"
    columns = {
        "bias": column(torch.float32, 0.0, _of("bias"), ("vocab",)),
        "min_tokens": column(torch.int64, 0, lambda r: r.params.min_tokens),
        "min_stop": column(torch.bool, False, _of("min_stop", ()), ("vocab",), marks=True),
        "words": column(torch.int64, -1, _of("words"), (BAD_WORDS, BAD_WORD_PREFIX + 1)),
        "recent": column(torch.int64, -3, shape=(BAD_WORD_PREFIX,)),
    }

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        validate_controls(p, where)

    def attach(self, req: Request, ctx: RequestContext, where: str) -> Any:
        return build_controls(req.params, ctx.tokenizer, ctx.vocab_size, ctx.eos_ids, where)

    def apply(self, logits: torch.Tensor, table: Any, batch: StepBatch) -> torch.Tensor:
        """vLLM's token controls, before the penalties: the additive bias, the multi-token bad
        words ``[B, W, P + 1]`` (a right-aligned prefix, ``ANY_TOKEN`` matching any token, and
        the token it bans) against each row's last ``P`` output tokens, and the ``min_tokens``
        stop ids while the output is shorter. Neutral rows (zero bias, no word, no stop ids)
        keep their logits bit-exact."""
        rows = batch.req_rows
        logits = logits + table.bias[rows]
        words, recent = table.words[rows], table.recent[rows]
        prefix, last = words[..., :-1], words[..., -1]
        matched = ((prefix == recent[:, None, :]) | (prefix == ANY_TOKEN)).all(dim=-1) & (last >= 0)
        hit = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
        hit = hit.scatter_reduce(1, last.clamp_min(0), matched.to(torch.int32), reduce="amax")
        below_min = batch.out_pos < table.min_tokens[rows]
        banned = (hit > 0) | (table.min_stop[rows] & below_min[:, None])
        return logits.masked_fill(banned, -torch.inf)

    def after_sample(self, table: Any, batch: StepBatch, ids: torch.Tensor) -> None:
        # the rows' recent outputs end with their kept samples (multi-token bad words)
        recent = table.recent[batch.req_rows]
        shifted = torch.cat([recent[:, 1:], ids[:, None]], dim=1)
        table.recent[batch.req_rows] = torch.where(batch.keeps[:, None] > 0, shifted, recent)


def validate_controls(p: Any, where: str, vocab_size: int | None = None) -> None:
    """Types and ranges of the controls; with ``vocab_size``, token ids too (vLLM's checks)."""
    if not is_integer(p.min_tokens) or not 0 <= p.min_tokens <= INT32_MAX:
        raise bad(where, "min_tokens", p.min_tokens, f"an int in [0, {INT32_MAX}]")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise bad(where, "min_tokens", p.min_tokens, f"at most max_tokens ({p.max_tokens})")
    bias = p.logit_bias
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            _token_key(k) and is_number(v) for k, v in bias.items()
        ):
            raise bad(where, "logit_bias", bias, "a dict of token id -> float")
        for tok, value in bias.items():
            if not (is_float32(value) or value == float("-inf")):
                expected = f"a float in [-{FLOAT32_MAX:.4g}, {FLOAT32_MAX:.4g}] or -inf"
                raise bad(where, f"logit_bias[{tok!r}]", value, expected)
        if vocab_size is not None:
            out = sorted(int(k) for k in bias if not 0 <= int(k) < vocab_size)
            if out:
                raise bad(where, "logit_bias", out, f"token ids in [0, {vocab_size})")
    allowed = p.allowed_token_ids
    if allowed is not None:
        if not isinstance(allowed, list | tuple) or not all(is_integer(t) for t in allowed):
            raise bad(where, "allowed_token_ids", allowed, "a list of token ids")
        if not allowed:
            raise bad(where, "allowed_token_ids", allowed, "a non-empty list (or None)")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in allowed):
            raise bad(where, "allowed_token_ids", allowed, f"token ids in [0, {vocab_size})")
    words = p.bad_words
    if words is not None and (
        not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words)
    ):
        raise bad(where, "bad_words", words, "a list of str")


def bad_word_ids(words: list[str] | None, tokenizer: Any, where: str) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as written (left-stripped) and, when its
    tokens differ in the first one only and have the same length, with a leading space."""
    out: list[list[int]] = []
    for word in words or []:
        if tokenizer is None:
            raise ValueError(f"{where}.bad_words: the model has no tokenizer to encode them")
        for spaced in (False, True):
            text = (" " if spaced else "") + word.lstrip()
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                continue
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


def build_controls(
    p: Any, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], where: str
) -> dict[str, Any] | None:
    """The request's table rows (None: it has none): the ``[vocab]`` additive ``bias`` (-inf
    bans: outside the allowed ids, single-token bad words), the ids ``min_tokens`` masks (EOS
    and the stop ids, also under ``ignore_eos``) and the multi-token bad ``words``
    ``[BAD_WORDS, BAD_WORD_PREFIX + 1]``, each right-aligned (``ANY_TOKEN`` to its left) with
    its banned token last (token -1: an unused word bans nothing)."""
    validate_controls(p, where, vocab_size)
    bias: dict[int, float] = {int(k): float(v) for k, v in (p.logit_bias or {}).items()}
    words = []
    for ids in bad_word_ids(p.bad_words, tokenizer, where):
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{where}.bad_words: token ids {ids} outside [0, {vocab_size})")
        if len(ids) == 1:
            bias[ids[0]] = -math.inf
        else:
            words.append(ids)
    if len(words) > BAD_WORDS or any(len(w) > BAD_WORD_PREFIX + 1 for w in words):
        raise ValueError(
            f"{where}.bad_words: {len(words)} multi-token words, the longest "
            f"{max(len(w) for w in words)} tokens; expected at most {BAD_WORDS} words of at "
            f"most {BAD_WORD_PREFIX + 1} tokens"
        )
    rows: dict[str, Any] = {}
    if bias or p.allowed_token_ids is not None:
        row = torch.zeros(vocab_size, dtype=torch.float32)
        if p.allowed_token_ids is not None:
            row.fill_(-math.inf)
            row[torch.tensor(p.allowed_token_ids, dtype=torch.int64)] = 0.0
        for tok, value in bias.items():
            row[tok] += value
        rows["bias"] = row
    if p.min_tokens > 0:
        ids = set(p.stop_token_ids or []) | set(eos_ids)
        rows["min_stop"] = tuple(sorted(t for t in ids if 0 <= t < vocab_size)) or None
    if words:
        table = torch.full((BAD_WORDS, BAD_WORD_PREFIX + 1), ANY_TOKEN, dtype=torch.int64)
        table[:, -1] = -1
        for i, word in enumerate(words):
            table[i, BAD_WORD_PREFIX + 1 - len(word) :] = torch.tensor(word, dtype=torch.int64)
        rows["words"] = table
    rows = {k: v for k, v in rows.items() if v is not None}
    return rows or None


def _token_key(value: object) -> bool:
    """A logit-bias key: an int, or its decimal string (JSON objects' keys are strings)."""
    return is_integer(value) or (isinstance(value, str) and value.lstrip("-").isdigit())
