"""Incremental detokenization: each request's output text, grown as its tokens arrive.

Decoding a whole output at every step costs O(n^2) over a long one. ``IncrementalText`` decodes
a short window instead (vLLM's prefix / read offsets): the window starts at the tokens of the
last piece of text it added, so the decoder sees their context (a byte-level merge, a word-piece
join), and a new token's text is what decoding the window with it adds to decoding it without.
A window whose text ends in U+FFFD is a character still split across tokens: it waits for the
next token, which is how a running output holds back a partial UTF-8 character. Once the
request finishes, what still waits is added as the whole decode shows it, so the final text is
the whole output decoded at once.

Detokenizing options, as vLLM applies them: ``skip_special_tokens`` drops special tokens from
the text (they are left out of the window altogether, so no window starts on one);
``spaces_between_special_tokens=False`` shows an added token that follows another added token
as its bare content, without the space a decoder may put before it (it only matters where
special tokens are shown); ``detokenize=False`` gives no text. A request that a stop token
ended leaves that token's text out (unless ``include_stop_str_in_output``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyloop.framework.requests import Request

PARTIAL = "\ufffd"  # what a decoder shows for bytes that are not yet a whole character


@dataclass
class IncrementalText:
    """One request's output text so far, and the window it decodes its next token in."""

    skip_special_tokens: bool
    skipped: frozenset[int] = frozenset()  # ids that add no text (special tokens, when skipped)
    bare: dict[int, str] | None = None  # added tokens shown bare after another added token
    text: str = ""
    consumed: int = 0  # output tokens taken in
    window: list[int] = field(default_factory=list)  # tokens since the window's start
    read: int = 0  # leading window tokens whose text is in ``text``
    window_text: str = ""  # the decoder's text of ``window[:read]``
    last_added: bool = False

    @classmethod
    def start(cls, tokenizer: Any, p: Any) -> IncrementalText:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        skip = bool(p.skip_special_tokens)
        if not skip:
            skipped: frozenset[int] = frozenset()
        elif added:
            skipped = frozenset(i for i, t in added.items() if getattr(t, "special", True))
        else:
            skipped = frozenset(getattr(tokenizer, "all_special_ids", ()))
        bare = None
        if not skip and not p.spaces_between_special_tokens and added:
            bare = {i: str(getattr(t, "content", t)) for i, t in added.items()}
        return cls(skip_special_tokens=skip, skipped=skipped, bare=bare)

    def take(self, tokenizer: Any, ids: list[int]) -> None:
        """Take in ``ids[consumed:]`` (``ids``: the output so far, or less)."""
        for tid in ids[self.consumed :]:
            self._step(tokenizer, tid)
        self.consumed = max(self.consumed, len(ids))

    def finish(self, tokenizer: Any, ids: list[int]) -> None:
        """Take in ``ids`` (the whole output to show) and add the text still waiting."""
        if self.consumed == 0 and self.bare is None:  # nothing decoded yet: one decode does it
            self.text = self._decode(tokenizer, ids)
            self.consumed = len(ids)
            return
        self.take(tokenizer, ids)
        if self.read < len(self.window):
            whole = self._decode(tokenizer, self.window)
            self.text += whole[len(self.window_text) :]
            self.read, self.window_text = len(self.window), whole

    def _decode(self, tokenizer: Any, ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, tokenizer: Any, tid: int) -> None:
        if tid in self.skipped:
            return
        if self.bare is not None:
            added = tid in self.bare
            follows, self.last_added = self.last_added, added
            if added and follows and self.read == len(self.window):
                self.text += self.bare[tid]
                self.window, self.read = [tid], 1
                self.window_text = self._decode(tokenizer, self.window)
                return
        self.window.append(tid)
        grown = self._decode(tokenizer, self.window)
        if len(grown) <= len(self.window_text) or grown.endswith(PARTIAL):
            return  # no new text yet, or a character still split: wait for the next token
        self.text += grown[len(self.window_text) :]
        # The next window starts at this piece's tokens: their text is its context.
        self.window = self.window[self.read :]
        self.read = len(self.window)
        self.window_text = self._decode(tokenizer, self.window)


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
