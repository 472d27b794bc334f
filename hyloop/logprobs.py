"""vLLM's ``vllm.logprobs`` module path."""

from hyloop.framework.outputs import Logprob, SampleLogprobs

__all__ = ["Logprob", "SampleLogprobs"]
