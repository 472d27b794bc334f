"""Paged attention and the compute paths its decode runs on."""

from hyloop.models.layers.attention.backends import (
    CompiledPath,
    NativePath,
    TorchPath,
    compute_paths,
)
from hyloop.models.layers.attention.paged import AttentionMeta, PagedAttention, QKVAttention

__all__ = [
    "AttentionMeta",
    "CompiledPath",
    "NativePath",
    "PagedAttention",
    "QKVAttention",
    "TorchPath",
    "compute_paths",
]
