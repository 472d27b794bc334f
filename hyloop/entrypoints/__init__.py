"""vLLM's ``vllm.entrypoints`` package path."""
