"""Prompts in vLLM's forms: a ``str``, a ``list[int]`` of token ids, a ``TextPrompt`` or
``TokensPrompt`` dict, or a list of any of these, and the checked ``Request`` made of one
(``new_request``). A dict's ``cache_salt`` (vLLM's field) names the prompt's cache namespace:
prompts with different salts never share cached KV. Every error names the request, the value
and what was expected; nothing here touches engine state, so a bad prompt fails alone."""

from __future__ import annotations

import time
from typing import Any, NotRequired, TypedDict

import torch

from hyloop.framework.requests import Request
from hyloop.framework.sampling_params import NotSupportedError, SamplingParams
from hyloop.graphs.ops import row_keys


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, echoed in the output
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
_KNOWN = {"prompt", "prompt_token_ids", "cache_salt"}
_VLLM_ONLY = {
    "multi_modal_data",
    "mm_processor_kwargs",
    "multi_modal_uuids",
    "prompt_embeds",
    "token_type_ids",
    "encoder_prompt",
    "decoder_prompt",
}


def check_text(where: str, text: str) -> None:
    """A ValueError naming ``where`` when ``text`` holds what UTF-8 cannot encode (a lone
    surrogate, as ``"\udc00"`` in JSON): no tokenizer, output file or client could take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: character {e.start} is {text[e.start]!r}, a lone surrogate; expected "
            "text UTF-8 can encode"
        ) from None


def split_prompt(where: str, prompt: Any) -> tuple[str | None, list[int] | str | Any]:
    """``(text shown in the output, what to tokenize or the ids)`` of one prompt; a dict's
    fields are checked here (an unknown one is an error naming it)."""
    text, what = _split(where, prompt)
    if isinstance(what, str):
        check_text(f"{where}: prompt", what)
    return text, what


def _split(where: str, prompt: Any) -> tuple[str | None, list[int] | str | Any]:
    if not isinstance(prompt, dict):
        return (prompt if isinstance(prompt, str) else None), prompt
    unknown = set(prompt) - _KNOWN
    for key in sorted(unknown):
        if key in _VLLM_ONLY:
            raise NotSupportedError(f"{where}: prompt field {key!r} is not supported by hyloop")
        raise ValueError(
            f"{where}: unknown prompt field {key!r}; a TextPrompt has `prompt`, a TokensPrompt "
            "`prompt_token_ids`"
        )
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list | tuple):
            raise ValueError(
                f"{where}: prompt_token_ids: got {type(ids).__name__}; expected a list of ints"
            )
        text = prompt.get("prompt")
        return (text if isinstance(text, str) else None), list(ids)
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: prompt: got {type(text).__name__}; expected a str")
        return text, text
    raise ValueError(f"{where}: a prompt dict needs `prompt` or `prompt_token_ids`")


def cache_salt(where: str, prompt: Any) -> str | None:
    """A prompt dict's ``cache_salt`` (None: none given), or a ValueError naming ``where``."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"{where}: cache_salt: got {salt!r}; expected a non-empty string")
    return salt


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
