"""vLLM's ``vllm.renderers`` package path."""
