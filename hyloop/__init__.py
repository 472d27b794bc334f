"""hyloop: a captured, cache-aware decode loop for dense and hybrid language models.

Its offline API is vLLM's: ``from hyloop import LLM, SamplingParams`` (and ``EngineArgs``,
``LLMEngine``, ``RequestOutput``, ``CompletionOutput``, ``TextPrompt``, ``TokensPrompt``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hyloop import omp_policy

# NOTE: before anything imports torch: libgomp reads its wait policy once, when it loads.
omp_policy.apply_default()

if TYPE_CHECKING:
    from hyloop.api.engine import LLMEngine
    from hyloop.api.engine_args import EngineArgs
    from hyloop.api.llm import LLM
    from hyloop.framework.outputs import CompletionOutput, Logprob, RequestOutput
    from hyloop.framework.prompts import PromptType, TextPrompt, TokensPrompt
    from hyloop.framework.sampling_params import RequestOutputKind, SamplingParams

# Lazy: importing a leaf package (hyloop.graphs, hyloop.cache) must not load the engine.
_EXPORTS = {
    "LLM": ("hyloop.api.llm", "LLM"),
    "LLMEngine": ("hyloop.api.engine", "LLMEngine"),
    "EngineArgs": ("hyloop.api.engine_args", "EngineArgs"),
    "SamplingParams": ("hyloop.framework.sampling_params", "SamplingParams"),
    "RequestOutputKind": ("hyloop.framework.sampling_params", "RequestOutputKind"),
    "RequestOutput": ("hyloop.framework.outputs", "RequestOutput"),
    "CompletionOutput": ("hyloop.framework.outputs", "CompletionOutput"),
    "Logprob": ("hyloop.framework.outputs", "Logprob"),
    "TextPrompt": ("hyloop.framework.prompts", "TextPrompt"),
    "TokensPrompt": ("hyloop.framework.prompts", "TokensPrompt"),
    "PromptType": ("hyloop.framework.prompts", "PromptType"),
}
__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "TextPrompt",
    "TokensPrompt",
    "PromptType",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hyloop' has no attribute {name!r}")
