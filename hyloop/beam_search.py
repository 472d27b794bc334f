"""vLLM's ``vllm.beam_search`` module path."""

from hyloop.api.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchSequence,
    create_sort_beams_key_function,
    get_beam_search_score,
)

__all__ = [
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "create_sort_beams_key_function",
    "get_beam_search_score",
]
