"""Stop strings: vLLM's ``stop`` / ``include_stop_str_in_output``, checked on the output text.

A stop string is looked for in the output text alone (never the prompt) each time that text
grows, and may span tokens. A match ends the request with ``finish_reason="stop"`` and the
matched string as its ``stop_reason``; the text is cut just before the string (or just after it
with ``include_stop_str_in_output``), while the token that completed the match stays in
``token_ids``. Stop strings are checked after the token stops: a request a stop token ended is
not searched, and a match on a request's last allowed token makes its finish ``stop``, not
``length``. Nothing is checked within the first ``min_tokens`` tokens.

Until a request finishes, its streamed text (``delta`` or ``cumulative``) holds back its last
``max(len(stop)) - 1`` characters when the strings are cut out of it, so a partial stop string is
never shown before the text after it proves it is not one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hyloop.features.base import Feature, RequestContext
from hyloop.framework.requests import has_text, text_of

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams


class StopStrings(Feature):
    """A host-only feature: the step never sees it; ``stop_hit`` matches each new token's text."""

    name = "stop_strings"
    in_step = False
    fields = {"stop": None}

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        stop = p.stop
        strings = isinstance(stop, list | tuple) and all(isinstance(s, str) for s in stop)
        if stop is not None and not isinstance(stop, str) and not strings:
            raise ValueError(f"{where}.stop: got {stop!r}; expected a str, a list of str or None")
        if isinstance(stop, str | list | tuple) and any(s == "" for s in _strings(stop)):
            raise ValueError(f"{where}.stop: got {stop!r}; expected non-empty strings")
        if stop and not p.detokenize:
            raise ValueError(
                f"{where}.stop: got {stop!r} with detokenize=False; stop strings are matched on "
                "the output text, so they need detokenize=True"
            )

    def attach(self, req: Request, ctx: RequestContext, where: str) -> Any:
        check_stop_request(where, req.params, ctx.tokenizer is not None and req.prompt_rows is None)
        req.text_hold = held_back(req.params)
        return stop_list(req.params) or None

    def stop_hit(self, req: Request, tokenizer: Any) -> str | None:
        return stop_string_hit(req, tokenizer)


def stop_string_hit(req: Request, tokenizer: Any) -> str | None:
    """The stop string ``req``'s newest token completed (its text then cut as vLLM cuts it), or
    None. Called once per appended token, and not for a token that already stopped it."""
    p = req.params
    if not p.stop or not has_text(req, tokenizer):
        return None
    state = text_of(req, tokenizer)
    before = len(state.text)
    state.take(tokenizer, req.output_ids)
    if len(req.output_ids) <= p.min_tokens:
        return None  # vLLM checks no stop string within min_tokens
    new_chars = len(state.text) - before
    hit = find_stop(state.text, new_chars, stop_list(p), p.include_stop_str_in_output)
    if hit is None:
        return None
    stop, cut = hit
    if cut >= 0:
        state.text = state.text[:cut]
    return stop


def check_stop_request(where: str, p: Any, has_text: bool) -> None:
    """A request whose stop strings could never be checked (no text to check them on)."""
    if p.stop and not has_text:
        raise ValueError(
            f"{where}: stop={p.stop!r} needs output text, and this model has none (no tokenizer, "
            "or multi-channel rows); pass stop_token_ids instead"
        )


def stop_list(p: Any) -> list[str]:
    """``p.stop`` as a list (vLLM takes a single string as a list of one)."""
    return _strings(p.stop) if p.stop else []


def held_back(p: Any) -> int:
    """Characters a running output holds back: a stop string cut from the text could still be
    starting in them (none when the strings stay in the text)."""
    stops = stop_list(p)
    if not stops or p.include_stop_str_in_output:
        return 0
    return max(len(s) for s in stops) - 1


def find_stop(text: str, new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """``(stop string, length to cut text to)`` for the first of ``stops`` (in list order, as
    vLLM tries them) found in ``text``'s last ``new_chars`` characters, reaching back far enough
    for a match that ends in them; the length is -1 when the text stays whole. None: no match.
    """
    if new_chars <= 0:
        return None
    for stop in stops:
        # NOTE: the search starts len(stop) - 1 characters before the new text, so a match must
        # end in the new text: text before it was searched when it was new.
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at < 0:
            continue
        if not include:
            return stop, at
        end = at + len(stop)
        return stop, (-1 if end >= len(text) else end)
    return None


def _strings(stop: str | list[str] | tuple[str, ...]) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop)
