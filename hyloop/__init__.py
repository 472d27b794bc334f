"""hyloop: a captured, cache-aware decode loop for dense and hybrid language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyloop.framework.llm import LLM
    from hyloop.framework.requests import RequestOutput
    from hyloop.framework.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy: importing a leaf package (hyloop.graphs, hyloop.cache) must not load the engine.
    if name == "LLM":
        from hyloop.framework.llm import LLM

        return LLM
    if name == "RequestOutput":
        from hyloop.framework.requests import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from hyloop.framework.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'hyloop' has no attribute {name!r}")
