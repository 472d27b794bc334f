"""hyloop: a captured, cache-aware decode loop for dense and hybrid language models."""

from hyloop.framework.llm import LLM
from hyloop.framework.request import RequestOutput
from hyloop.framework.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
