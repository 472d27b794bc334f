"""vLLM's ``vllm.sampling_params`` module path."""

from hyloop.api.beam_search import BeamSearchParams
from hyloop.features.structured_params import GuidedDecodingParams, StructuredOutputsParams
from hyloop.framework.sampling_params import (
    NotSupportedError,
    RequestOutputKind,
    SamplingParams,
)

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "NotSupportedError",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
