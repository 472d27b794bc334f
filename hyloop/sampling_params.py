"""vLLM's ``vllm.sampling_params`` module path."""

from hyloop.framework.sampling_params import (
    NotSupportedError,
    RequestOutputKind,
    SamplingParams,
)

__all__ = ["NotSupportedError", "RequestOutputKind", "SamplingParams"]
