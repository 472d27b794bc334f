"""Chats rendered into prompts: OpenAI messages (string content or text parts) checked, then
rendered with the checkpoint's chat template, as ``LLM.chat``, ``hyloop generate`` and
``hyloop run-batch`` send them."""

from __future__ import annotations

from typing import Any, Literal

from hyloop.framework.prompts import TokensPrompt
from hyloop.framework.sampling_params import NotSupportedError

ContentFormat = Literal["auto", "string", "openai"]


def check_messages(where: str, messages: Any, content_format: str = "auto") -> list[dict[str, Any]]:
    """The chat with each message's content as the template reads it: text parts joined by a
    newline (``string``, also ``auto``) or kept as ``[{"type": "text", "text": ...}]``
    (``openai``). A malformed message raises naming ``where`` and the message's index."""
    if content_format not in ("auto", "string", "openai"):
        raise ValueError(
            f"{where}: chat_template_content_format={content_format!r}; expected 'auto', "
            "'string' or 'openai'"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: messages: got {messages!r}; expected a non-empty list of "
            '{"role": ..., "content": ...} objects'
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"{where}: messages[{i}]: got {message!r}; expected an object with a string "
                "`role` and a `content`"
            )
        content = message.get("content")
        if isinstance(content, list):
            texts = [
                _text_part(f"{where}: messages[{i}].content[{j}]", p) for j, p in enumerate(content)
            ]
            content = (
                [{"type": "text", "text": t} for t in texts]
                if content_format == "openai"
                else "\n".join(texts)
            )
        elif content is None:
            if not message.get("tool_calls"):
                raise ValueError(f"{where}: messages[{i}]: no `content`")
        elif not isinstance(content, str):
            raise ValueError(
                f"{where}: messages[{i}].content: got {type(content).__name__}; expected a "
                "string or a list of text parts"
            )
        out.append({**message, "content": content})
    return out


def _text_part(where: str, part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or "type" not in part:
        raise ValueError(f'{where}: got {part!r}; expected {{"type": "text", "text": ...}}')
    kind = part["type"]
    if kind in ("text", "input_text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("text", "input_text"):
        raise ValueError(f"{where}: a text part needs a string `text`")
    raise NotSupportedError(f"{where}: content part type {kind!r} is not supported (text only)")


def render_chat(
    where: str,
    messages: Any,
    tokenizer: Any,
    chat_template: str | None = None,
    content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> TokensPrompt:
    """The chat as a prompt: its rendered text and that text's ids without the tokenizer's
    special tokens (the template writes its own BOS, as HF and vLLM tokenize a chat); every
    failure is a ValueError naming ``where``."""
    chat = check_messages(where, messages, content_format)
    if tokenizer is None:
        raise ValueError(
            f"{where}: this model has no tokenizer, so a chat cannot be rendered; give token ids"
        )
    if not (chat_template or tokenizer.chat_template):
        raise ValueError(
            f"{where}: this model has no chat template (GGUF `tokenizer.chat_template`, or "
            "tokenizer_config.json / chat_template.jinja of an HF directory); pass "
            "chat_template=... or give plain prompts"
        )
    import jinja2  # the template engine apply_chat_template renders with

    try:
        text = tokenizer.apply_chat_template(
            chat,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"{where}: the chat template rejected the messages: {e}") from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    assert isinstance(text, str)
    return TokensPrompt(
        prompt=text, prompt_token_ids=tokenizer.encode(text, add_special_tokens=False)
    )
