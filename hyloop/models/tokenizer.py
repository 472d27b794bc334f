"""Text tokenizer wrapper over ``tokenizers`` with the checkpoint's BOS rule and chat template;
and incremental detokenization over any tokenizer (``IncrementalText``).

Decoding a whole output at every step costs O(n^2). ``IncrementalText`` decodes a short window
(vLLM's prefix / read offsets) that starts at the tokens of the last piece of text it added, so
the decoder sees their context; a new token's text is what decoding the window with it adds to
decoding it without. A window whose text ends in U+FFFD is a character still split across
tokens: it waits for the next token. Once the request finishes, what still waits is added as the
whole decode shows it, so the final text is the whole output decoded at once. Options as vLLM
applies them: ``skip_special_tokens`` leaves special tokens out of the window altogether;
``spaces_between_special_tokens=False`` shows an added token that follows another added token
as its bare content, without the space a decoder may put before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from hyloop.models.loaders.hf import read_json

PARTIAL = "\ufffd"  # what a decoder shows for bytes that are not yet a whole character


class BatchEncoding(dict[str, Any]):
    """HF's ``BatchEncoding`` shape: a dict whose keys are also attributes
    (``enc["input_ids"]`` and ``enc.input_ids``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"BatchEncoding has no {name!r}") from None


class TextTokenizer:
    """An HF-compatible tokenizer over ``tokenizers``: ``tok(text)``, ``encode`` (with the
    checkpoint's leading-BOS rule), ``decode``, special-token ids, ``apply_chat_template`` with
    HF's arguments. No chat template unless the checkpoint ships one."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        add_bos: bool,
        bos_id: int | None,
        chat_template: str | None,
        special_tokens: dict[str, str] | None = None,
        post_processor_adds_bos: bool = False,
        eos_ids: list[int] | None = None,
        name_or_path: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.add_bos = add_bos
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._pp_bos = post_processor_adds_bos
        self.eos_ids = list(eos_ids or [])
        self.name_or_path = name_or_path
        self._added: dict[int, AddedToken] | None = None
        self._pad_id: int | None = None

    # -- HF's attributes ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        if "bos_token" in self.special_tokens or self.bos_id is None:
            return self.special_tokens.get("bos_token")
        return self.tokenizer.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        if "eos_token" in self.special_tokens or not self.eos_ids:
            return self.special_tokens.get("eos_token")
        return self.tokenizer.id_to_token(self.eos_ids[0])

    @property
    def bos_token_id(self) -> int | None:
        return self.bos_id

    @property
    def eos_token_id(self) -> int | None:
        if self.eos_ids:
            return self.eos_ids[0]
        return self.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def pad_token_id(self) -> int | None:
        """None unless set: hyloop never pads; clients that batch set one (HF's setter)."""
        return self._pad_id

    @pad_token_id.setter
    def pad_token_id(self, value: int | None) -> None:
        self._pad_id = value

    @property
    def pad_token(self) -> str | None:
        return None if self._pad_id is None else self.tokenizer.id_to_token(self._pad_id)

    @property
    def all_special_ids(self) -> list[int]:
        ids = {self.bos_id, *self.eos_ids}
        return sorted(i for i in ids if i is not None)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """HF's map of added token ids to their ``AddedToken`` (``.content``, ``.special``)."""
        if self._added is None:
            self._added = dict(self.tokenizer.get_added_tokens_decoder())
        return self._added

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids) or ""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    # -- encode / decode ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if self._pp_bos:  # the tokenizer.json post-processor is the checkpoint's own rule
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def __call__(
        self,
        text: str | list[str],
        add_special_tokens: bool = True,
        return_attention_mask: bool = True,
        **kwargs: Any,
    ) -> BatchEncoding:
        """HF's call: a ``BatchEncoding`` of ``input_ids`` (and ``attention_mask``)."""
        if kwargs.get("return_tensors") is not None:
            raise ValueError("TextTokenizer(...): return_tensors is not supported; lists only")
        if isinstance(text, str):
            ids: Any = self.encode(text, add_special_tokens)
            mask: Any = [1] * len(ids)
        else:
            ids = [self.encode(t, add_special_tokens) for t in text]
            mask = [[1] * len(i) for i in ids]
        if not return_attention_mask:
            return BatchEncoding(input_ids=ids)
        return BatchEncoding(input_ids=ids, attention_mask=mask)

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """HF's signature and defaults (``tokenize=True``, no generation prompt): the chat
        rendered with ``chat_template`` or the checkpoint's; ``continue_final_message`` leaves
        the last message open for the model to continue."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this checkpoint has no chat template; pass plain prompts instead")
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "apply_chat_template: add_generation_prompt and continue_final_message are "
                "exclusive (the first opens a new assistant turn, the second continues the last)"
            )
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        text = env.from_string(template).render(
            messages=conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**specials, **self.special_tokens, **kwargs},
        )
        if continue_final_message:
            last = conversation[-1].get("content") if conversation else None
            if not isinstance(last, str) or last.strip() not in text:
                raise ValueError(
                    "continue_final_message: the final message's text is not in the rendered "
                    "chat, so it cannot be continued"
                )
            text = text[: text.rindex(last.strip()) + len(last.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_hf_tokenizer(ckpt: Path) -> TextTokenizer | None:
    """The tokenizer of an HF directory, or None when it ships no ``tokenizer.json``."""
    tok_file = ckpt / "tokenizer.json"
    if not tok_file.is_file():
        return None
    tok = Tokenizer.from_file(str(tok_file))
    cfg_file = ckpt / "tokenizer_config.json"
    cfg = read_json(cfg_file) if cfg_file.is_file() else {}
    bos = _token_str(cfg.get("bos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    template = cfg.get("chat_template")
    tmpl_file = ckpt / "chat_template.jinja"
    if template is None and tmpl_file.is_file():
        template = tmpl_file.read_text()
    specials = {
        k: s for k in ("bos_token", "eos_token") if (s := _token_str(cfg.get(k))) is not None
    }
    probe = tok.encode("a", add_special_tokens=True).ids
    pp_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    return TextTokenizer(
        tok,
        add_bos=bool(cfg.get("add_bos_token", pp_bos)),
        bos_id=bos_id,
        chat_template=template if isinstance(template, str) else None,
        special_tokens=specials,
        post_processor_adds_bos=pp_bos,
    )


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
