"""Paged attention and the compute paths its decode runs on."""

from hyloop.models.layers.attention.backends import (
    CompiledPath,
    NativePath,
    TorchPath,
    compute_paths,
)
from hyloop.models.layers.attention.paged import AttentionMeta, PagedAttention

__all__ = [
    "AttentionMeta",
    "CompiledPath",
    "NativePath",
    "PagedAttention",
    "TorchPath",
    "compute_paths",
]
