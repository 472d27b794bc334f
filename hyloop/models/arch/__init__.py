"""Model architectures; importing this package registers them."""

from hyloop.models.arch import llama, qwen3_next, row_lm

__all__ = ["llama", "qwen3_next", "row_lm"]
