"""Paged attention and the compute paths it runs on."""

from hyloop.models.layers.attention.paged import (
    AttentionMeta,
    CompiledPath,
    NativePath,
    PagedAttention,
    TorchPath,
    compute_paths,
)

__all__ = [
    "AttentionMeta",
    "CompiledPath",
    "NativePath",
    "PagedAttention",
    "TorchPath",
    "compute_paths",
]
