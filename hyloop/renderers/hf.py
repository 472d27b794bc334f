"""vLLM's ``vllm.renderers.hf`` module path (where later vLLM moved the chat-template lookup)."""

from hyloop.entrypoints.chat_utils import resolve_hf_chat_template

resolve_chat_template = resolve_hf_chat_template

__all__ = ["resolve_chat_template", "resolve_hf_chat_template"]
