"""Text tokenizer wrapper over ``tokenizers`` with the checkpoint's BOS rule and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from hyloop.models.loaders.hf import read_json


class TextTokenizer:
    """``encode`` follows the checkpoint's leading-BOS rule; no chat template unless asked."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        add_bos: bool,
        bos_id: int | None,
        chat_template: str | None,
        special_tokens: dict[str, str] | None = None,
        post_processor_adds_bos: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.add_bos = add_bos
        self.bos_id = bos_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self._pp_bos = post_processor_adds_bos

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self._pp_bos:  # the tokenizer.json post-processor is the checkpoint's own rule
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; pass plain prompts instead")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )


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
