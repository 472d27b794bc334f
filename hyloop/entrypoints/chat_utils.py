"""vLLM's ``vllm.entrypoints.chat_utils`` module path: the chat template a client renders with."""

from __future__ import annotations

from typing import Any


def resolve_hf_chat_template(
    tokenizer: Any,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
    *,
    model_config: Any = None,
    trust_remote_code: bool | None = None,
) -> str | None:
    """The template a chat is rendered with: ``chat_template`` when given, else the
    tokenizer's own (a GGUF's ``tokenizer.chat_template`` or an HF directory's); None when the
    checkpoint ships none. ``tools``, ``model_config`` and ``trust_remote_code`` are vLLM's
    keywords: hyloop's checkpoints carry one template, whatever the tools."""
    if chat_template is not None:
        return chat_template
    return getattr(tokenizer, "chat_template", None)
