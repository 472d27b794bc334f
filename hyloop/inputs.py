"""vLLM's ``vllm.inputs`` module path."""

from hyloop.framework.prompts import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
