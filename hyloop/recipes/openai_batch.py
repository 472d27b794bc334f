"""The input side of ``hyloop run-batch``: each line of an OpenAI Batch file checked, without
the model, into the request it asks for (its prompt, its SamplingParams fields, its output
constraint, its chat template keywords, its ``cache_salt``) or the error its output line
reports."""

from __future__ import annotations

import difflib
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hyloop.api.chat import check_messages
from hyloop.framework.sampling_params import NotSupportedError, SamplingParams, is_integer
from hyloop.recipes.job import check_strings
from hyloop.recipes.openai_constraints import GUIDED, short, structured_outputs

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_IN_RANGE = f"expected an int in [0, {MAX_LOGPROBS}]"
# Body fields that set the SamplingParams field of the same name (vLLM's names).
SAMPLING = (
    *("temperature", "top_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty"),
    *("logit_bias", "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids"),
    *("skip_special_tokens", "min_tokens", "truncate_prompt_tokens"),
    *("include_stop_str_in_output", "spaces_between_special_tokens"),
    *("allowed_token_ids", "bad_words"),
)
_CHAT_ONLY = {
    *("messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt"),
    *("continue_final_message", "chat_template", "chat_template_kwargs"),
    "bad_words",  # vLLM's completions take no bad_words
}
_COMPLETION_ONLY = {"prompt", "echo", "suffix", "best_of"}
_COMMON = {
    *("model", "max_tokens", "logprobs", "user", "parallel_tool_calls", "stream", *SAMPLING),
    *("response_format", "structured_outputs", *GUIDED),
    "cache_salt",  # vLLM's: the request's cache namespace
} - _CHAT_ONLY
FIELDS = {CHAT: _COMMON | _CHAT_ONLY, COMPLETION: _COMMON | _COMPLETION_ONLY}
# OpenAI / vLLM fields hyloop has no control for: fine at a neutral value, refused otherwise.
UNSUPPORTED = {
    *("tools", "tool_choice", "functions", "function_call", "audio", "stream_options"),
    *("modalities", "prediction", "reasoning_effort", "web_search_options", "service_tier"),
    *("store", "metadata", "prompt_logprobs", "echo", "suffix", "stream"),
}
# render_chat's own parameters, which chat_template_kwargs may not set.
_SURROGATE = re.compile("[\ud800-\udfff]")  # what strict UTF-8 cannot encode
_RESERVED_KWARGS = {
    *("add_generation_prompt", "continue_final_message", "chat_template", "content_format"),
    *("tools", "tokenize", "conversation", "messages"),
}


class RowError(ValueError):
    """What is wrong with one row: its error line's status, code and message."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code

    @classmethod
    def of(cls, error: Exception) -> RowError:
        if isinstance(error, RowError):
            return error
        if isinstance(error, NotSupportedError):
            return cls(str(error), code="not_supported")
        if isinstance(error, ValueError):
            return cls(str(error))
        return cls(f"{type(error).__name__}: {error}", status=500, code="internal_error")


@dataclass
class BatchRow:
    """One input line: the request it asks for, or (``error``) why it gets none."""

    line: int
    custom_id: str | None = None
    url: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    prompt: str | list[int] | None = None  # completion rows; a chat is rendered after load
    sampling: dict[str, Any] = field(default_factory=dict)  # the SamplingParams fields set
    chat_kwargs: dict[str, Any] = field(default_factory=dict)  # render_chat keywords
    cache_salt: str | None = None  # shares cached KV only with rows of the same salt
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    error: RowError | None = None

    @property
    def where(self) -> str:
        return f"line {self.line}"


def parse_rows(lines: Iterable[str | ValueError], served: str | None) -> list[BatchRow]:
    """A row per non-blank line, in order; ``served``: the name a body's ``model`` must match
    (None: any name). A row that fails a check carries its error; the rest still parse. A line
    given as a ValueError (it could not be decoded) is that row's error."""
    rows: list[BatchRow] = []
    seen: set[str] = set()
    for n, text in enumerate(lines, 1):
        if isinstance(text, ValueError):
            rows.append(BatchRow(line=n, error=RowError(f"line {n}: {text}")))
            continue
        if not text.strip():
            continue
        row = BatchRow(line=n)
        try:
            _parse(row, text, seen, served)
        except ValueError as e:
            row.error = RowError.of(e)
        rows.append(row)
    return rows


def _parse(row: BatchRow, text: str, seen: set[str], served: str | None) -> None:
    where = row.where
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RowError(f"{where}: got {short(obj)}; expected a JSON object")
    cid = obj.get("custom_id")
    if isinstance(cid, str) and not _SURROGATE.search(cid):  # UTF-8 can encode it
        row.custom_id = cid  # its error line names it, whatever else is wrong
    check_strings(where, obj)  # a lone surrogate could reach neither a tokenizer nor the output
    for key in ("custom_id", "method", "url", "body"):
        if key not in obj:
            raise RowError(f"{where}: no `{key}`; a row has custom_id, method, url and body")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise RowError(
            f"{where}: unknown field {unknown[0]!r} (a row has custom_id, method, url, body)"
        )
    if not isinstance(obj["custom_id"], str):
        raise RowError(f"{where}: custom_id: got {short(obj['custom_id'])}; expected a string")
    if obj["custom_id"] in seen:
        raise RowError(f"{where}: custom_id {obj['custom_id']!r} is used by an earlier line")
    seen.add(obj["custom_id"])
    if obj["method"] != "POST":
        raise RowError(f"{where}: method: got {short(obj['method'])}; expected 'POST'")
    if obj["url"] not in FIELDS:
        raise RowError(
            f"{where}: url: got {short(obj['url'])}; run-batch serves {CHAT!r} and {COMPLETION!r}",
            status=404,
            code="not_found",
        )
    if not isinstance(obj["body"], dict):
        raise RowError(f"{where}: body: got {short(obj['body'])}; expected a JSON object")
    row.url, row.body = obj["url"], obj["body"]
    _check_fields(where, row.url, row.body, served)
    row.sampling = sampling_fields(where, row.url, row.body)
    salt = row.body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RowError(f"{where}: body.cache_salt: got {short(salt)}; expected a non-empty string")
    row.cache_salt = salt
    if row.url == CHAT:
        row.chat_kwargs = _chat_kwargs(where, row.body)
    else:
        row.prompt = completion_prompt(where, row.body.get("prompt"))


def _check_fields(where: str, url: str, body: dict[str, Any], served: str | None) -> None:
    known = FIELDS[url]
    for key in sorted(body):
        value = body[key]
        if key in UNSUPPORTED and value not in (None, False, [], {}, ""):
            raise NotSupportedError(
                f"{where}: body.{key}={short(value)} is not supported by hyloop"
            )
        if key not in known and key not in UNSUPPORTED:
            near = difflib.get_close_matches(key, sorted(known), n=2, cutoff=0.8)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise RowError(f"{where}: body: unknown field {key!r} for {url}{hint}")
    needed = "messages" if url == CHAT else "prompt"
    if body.get(needed) is None:
        raise RowError(f"{where}: body: no `{needed}` (required by {url})")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RowError(f"{where}: body.model: got {short(model)}; expected a string")
    if served is not None and model is not None and model != served:
        raise RowError(
            f"{where}: body.model: the model {model!r} does not exist; this batch serves "
            f"{served!r} (--served-model-name)",
            status=404,
            code="model_not_found",
        )


def sampling_fields(where: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields the body sets (a null field sets nothing), checked by
    ``SamplingParams.validate`` over vLLM's defaults; errors name the body's field."""
    out = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    names = ("max_completion_tokens", "max_tokens") if url == CHAT else ("max_tokens",)
    given = {k: body[k] for k in names if body.get(k) is not None}
    for key, value in given.items():
        if not is_integer(value) or value < 1:
            raise RowError(f"{where}: body.{key}: got {short(value)}; expected an int >= 1")
    if len(set(given.values())) > 1:
        raise RowError(f"{where}: body: max_completion_tokens and max_tokens differ; give one")
    if given:
        out["max_tokens"] = next(iter(given.values()))
    logprobs = body.get("logprobs")
    if url == CHAT:
        top = body.get("top_logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RowError(f"{where}: body.logprobs: got {short(logprobs)}; expected a bool")
        if top is not None and (not is_integer(top) or not 0 <= top <= MAX_LOGPROBS):
            raise RowError(f"{where}: body.top_logprobs: got {short(top)}; {_IN_RANGE}")
        if top and not logprobs:
            raise RowError(f"{where}: body.top_logprobs needs body.logprobs: true")
        if logprobs:
            out["logprobs"] = top or 0
    else:
        if logprobs is not None and (not is_integer(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise RowError(f"{where}: body.logprobs: got {short(logprobs)}; {_IN_RANGE}")
        if logprobs is not None:
            out["logprobs"] = logprobs
        if body.get("best_of") is not None:
            out["best_of"] = body["best_of"]
    constraint = structured_outputs(where, body)
    if constraint is not None:
        out["structured_outputs"] = constraint
    SamplingParams(**out).validate(f"{where}: body")
    return out


def _chat_kwargs(where: str, body: dict[str, Any]) -> dict[str, Any]:
    check_messages(f"{where}: body", body["messages"])
    kwargs: dict[str, Any] = {}
    for key in ("add_generation_prompt", "continue_final_message"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise RowError(f"{where}: body.{key}: got {short(value)}; expected a bool")
        if value is not None:
            kwargs[key] = value
    if kwargs.get("continue_final_message"):  # the last message is continued, not answered
        if kwargs.get("add_generation_prompt"):
            raise RowError(
                f"{where}: body: continue_final_message and add_generation_prompt both true"
            )
        kwargs["add_generation_prompt"] = False
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise RowError(f"{where}: body.chat_template: got {short(template)}; expected a string")
    if template is not None:
        kwargs["chat_template"] = template
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise RowError(
            f"{where}: body.chat_template_kwargs: got {short(extra)}; expected an object"
        )
    for key in sorted(extra or {}):
        if key in _RESERVED_KWARGS:
            raise RowError(f"{where}: body.chat_template_kwargs.{key}: set it in the body instead")
    return {**(extra or {}), **kwargs}


def completion_prompt(where: str, prompt: Any) -> str | list[int]:
    """A completion's one prompt: a string, token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and not is_integer(prompt[0]):
        prompt = prompt[0]
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str) or _token_ids(p) for p in prompt)
    ):
        raise RowError(
            f"{where}: body.prompt: a list of {len(prompt)} prompts; run-batch takes one "
            "prompt per line (give each prompt its own line and custom_id)"
        )
    if isinstance(prompt, str) and prompt:
        return prompt
    if _token_ids(prompt):
        return list(prompt)
    raise RowError(
        f"{where}: body.prompt: got {short(prompt)}; expected a non-empty string, a list of "
        "token ids, or a list of one of those"
    )


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(is_integer(t) for t in value)
