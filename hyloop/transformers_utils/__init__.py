"""vLLM's ``vllm.transformers_utils`` package path."""
