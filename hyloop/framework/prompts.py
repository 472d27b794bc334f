"""Prompts in vLLM's forms: a ``str``, a ``list[int]`` of token ids, a ``TextPrompt`` or
``TokensPrompt`` dict, or a list of any of these. A dict's ``cache_salt`` (vLLM's field) names
the prompt's cache namespace: prompts with different salts never share cached KV."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from hyloop.framework.sampling_params import NotSupportedError


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
