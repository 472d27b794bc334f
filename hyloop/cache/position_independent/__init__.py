"""Position-independent reuse, the cache side: content-defined chunker, donor index, planner.

Model-agnostic: a plan names donor runs and their KV slots; moving K to new positions lives with
the models (``hyloop.models.kv_shift``) and the engine wires both (``hyloop.framework``).
"""

from hyloop.cache.position_independent.chunker import Chunker, ChunkerParams
from hyloop.cache.position_independent.index import DonorEntry, DonorIndex
from hyloop.cache.position_independent.planner import ReusePlan, ReusePlanner, Segment

__all__ = [
    "Chunker",
    "ChunkerParams",
    "DonorEntry",
    "DonorIndex",
    "ReusePlan",
    "ReusePlanner",
    "Segment",
]
