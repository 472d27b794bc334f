"""vLLM's ``vllm.lora`` package path: hyloop serves no LoRA adapters."""
