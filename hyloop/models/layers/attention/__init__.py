"""Paged attention and the compute paths its decode runs on."""

from hyloop.models.layers.attention.backends import (
    CompiledPath,
    NativePath,
    TorchPath,
    compute_paths,
)
from hyloop.models.layers.attention.paged import PagedAttention, attention_meta, place_kv_layers

__all__ = [
    "CompiledPath",
    "NativePath",
    "PagedAttention",
    "TorchPath",
    "attention_meta",
    "compute_paths",
    "place_kv_layers",
]
