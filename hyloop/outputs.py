"""vLLM's ``vllm.outputs`` module path."""

from hyloop.framework.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput"]
