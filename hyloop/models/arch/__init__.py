"""Model architectures; importing this package registers them."""

from hyloop.models.arch import gemma3, llama, moss_tts_local, qwen3_next

__all__ = ["gemma3", "llama", "moss_tts_local", "qwen3_next"]
