"""The logits controls of a token request, as its step-table rows see them.

vLLM's ``min_p``, ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` become
per-request device tensors (``TokenSampling``) that the captured step applies with no host round
trip: one additive ``bias`` row per request (the logit bias, ``-inf`` outside the allowed ids and
on single-token bad words), a ``min_p`` value, the stop ids ``min_tokens`` masks with the count
it masks them for, and each multi-token bad word as a right-aligned prefix and the token it bans
once the output ends with that prefix (``BAD_WORDS`` words of up to ``BAD_WORD_PREFIX + 1``
tokens; the step keeps each row's last ``BAD_WORD_PREFIX`` output tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Static sizes of the bad-word tables (the step keeps this many recent output tokens per row).
BAD_WORDS = 8
BAD_WORD_PREFIX = 7
ANY_TOKEN = -2  # a prefix position that matches any recent token (a shorter word's left end)


def controlled(p: Any) -> bool:
    """Whether a request carries any logits control (an eager step applies them only then)."""
    return bool(
        p.min_p > 0.0
        or p.logit_bias
        or p.allowed_token_ids is not None
        or p.bad_words
        or p.min_tokens > 0
    )


def validate_controls(p: Any, where: str, vocab_size: int | None = None) -> None:
    """Types and ranges of the controls; with ``vocab_size``, token ids too (vLLM's checks)."""

    def bad(name: str, value: object, expected: str) -> ValueError:
        return ValueError(f"{where}.{name}: got {value!r}; expected {expected}")

    if not _number(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise bad("min_p", p.min_p, "a float in [0, 1]")
    if not _integer(p.min_tokens) or p.min_tokens < 0:
        raise bad("min_tokens", p.min_tokens, "an int >= 0")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise bad("min_tokens", p.min_tokens, f"at most max_tokens ({p.max_tokens})")
    bias = p.logit_bias
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            _token_key(k) and _number(v) for k, v in bias.items()
        ):
            raise bad("logit_bias", bias, "a dict of token id -> float")
        if vocab_size is not None:
            out = sorted(int(k) for k in bias if not 0 <= int(k) < vocab_size)
            if out:
                raise bad("logit_bias", out, f"token ids in [0, {vocab_size})")
    allowed = p.allowed_token_ids
    if allowed is not None:
        if not isinstance(allowed, list | tuple) or not all(_integer(t) for t in allowed):
            raise bad("allowed_token_ids", allowed, "a list of token ids")
        if not allowed:
            raise bad("allowed_token_ids", allowed, "a non-empty list (or None)")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in allowed):
            raise bad("allowed_token_ids", allowed, f"token ids in [0, {vocab_size})")
    words = p.bad_words
    if words is not None and (
        not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words)
    ):
        raise bad("bad_words", words, "a list of str")


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


@dataclass(frozen=True)
class Controls:
    """A request's controls as step-table rows (built once, when the request is created)."""

    vocab: int
    bias: dict[int, float]  # additive logit bias; -inf bans
    allowed: tuple[int, ...] | None  # every other token is banned
    words: tuple[tuple[int, ...], ...]  # multi-token bad words (prefix + the banned last token)
    min_stop: tuple[int, ...]  # the ids ``min_tokens`` masks (EOS and stop ids), or ()

    def bias_row(self) -> torch.Tensor | None:
        """The ``[vocab]`` additive row (None: all zeros)."""
        if not self.bias and self.allowed is None:
            return None
        row = torch.zeros(self.vocab, dtype=torch.float32)
        if self.allowed is not None:
            row.fill_(-math.inf)
            row[torch.tensor(self.allowed, dtype=torch.int64)] = 0.0
        for tok, value in self.bias.items():
            row[tok] += value
        return row

    def word_table(self) -> torch.Tensor | None:
        """``[BAD_WORDS, BAD_WORD_PREFIX + 1]`` int64: each word right-aligned (``ANY_TOKEN``
        to its left), its banned token last; unused words ban nothing (token -1). None: no
        multi-token word."""
        if not self.words:
            return None
        table = torch.full((BAD_WORDS, BAD_WORD_PREFIX + 1), ANY_TOKEN, dtype=torch.int64)
        table[:, -1] = -1
        for i, word in enumerate(self.words):
            table[i, BAD_WORD_PREFIX + 1 - len(word) :] = torch.tensor(word, dtype=torch.int64)
        return table


def build_controls(
    p: Any, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], where: str
) -> Controls | None:
    """The request's ``Controls`` (None: it has none that a table row holds). ``min_tokens``
    masks EOS and the stop ids, also under ``ignore_eos``."""
    validate_controls(p, where, vocab_size)
    bias: dict[int, float] = {int(k): float(v) for k, v in (p.logit_bias or {}).items()}
    words = []
    for ids in bad_word_ids(p.bad_words, tokenizer, where):
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{where}.bad_words: token ids {ids} outside [0, {vocab_size})")
        if len(ids) == 1:
            bias[ids[0]] = -math.inf
        else:
            words.append(tuple(ids))
    if len(words) > BAD_WORDS or any(len(w) > BAD_WORD_PREFIX + 1 for w in words):
        raise ValueError(
            f"{where}.bad_words: {len(words)} multi-token words, the longest "
            f"{max(len(w) for w in words)} tokens; expected at most {BAD_WORDS} words of at "
            f"most {BAD_WORD_PREFIX + 1} tokens"
        )
    allowed = tuple(p.allowed_token_ids) if p.allowed_token_ids is not None else None
    min_stop: tuple[int, ...] = ()
    if p.min_tokens > 0:
        ids = set(p.stop_token_ids or []) | set(eos_ids)
        min_stop = tuple(sorted(t for t in ids if 0 <= t < vocab_size))
    if not bias and allowed is None and not words and not min_stop:
        return None
    return Controls(vocab_size, bias, allowed, tuple(words), min_stop)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_key(value: object) -> bool:
    """A logit-bias key: an int, or its decimal string (JSON objects' keys are strings)."""
    return _integer(value) or (isinstance(value, str) and value.lstrip("-").isdigit())


class RequestControls:
    """What an engine attaches to each new request: its controls' table rows and, for a
    structured output, its grammar matcher (``structured``; the grammar's view of the
    tokenizer is built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._grammar_tokenizer: Any = None

    def attach(self, req: Any, where: str) -> None:
        p = req.params
        req.controls = build_controls(p, self.tokenizer, self.vocab_size, self.eos_ids, where)
        if p.structured_outputs is None:
            return
        from hyloop.framework.structured import GrammarMatcher, grammar_tokenizer

        if self.tokenizer is None or req.prompt_rows is not None:
            raise ValueError(f"{where}.structured_outputs: the model has no tokenizer")
        if self._grammar_tokenizer is None:
            eos = sorted(self.eos_ids)
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, eos)
        req.grammar = GrammarMatcher(
            p.structured_outputs, self._grammar_tokenizer, f"{where}.structured_outputs"
        )
