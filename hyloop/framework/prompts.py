"""Prompt validation: a request's prompt -> token ids (or multi-channel rows and their keys).

Every error names the request, the value and what was expected; nothing here touches engine
state, so a bad prompt fails alone.
"""

from __future__ import annotations

from typing import Any

import torch

from hyloop.framework.sampling_params import SamplingParams
from hyloop.graphs.ops import row_keys


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
