"""vLLM's ``vllm.tokenizers`` package path (where later vLLM moved ``get_tokenizer``).

NOTE: hyloop imports absolutely, so this subpackage never hides the ``tokenizers`` library."""

from hyloop.transformers_utils.tokenizer import get_tokenizer

__all__ = ["get_tokenizer"]
