"""vLLM's ``vllm.sampling_params`` module path."""

from hyloop.framework.beam_search import BeamSearchParams
from hyloop.framework.sampling_params import (
    NotSupportedError,
    RequestOutputKind,
    SamplingParams,
)
from hyloop.framework.structured_params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "NotSupportedError",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
