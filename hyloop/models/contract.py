"""What an architecture tells assembly: the pools it needs, its positions, its row layout.

Every model class builds a ``ModelContract`` at construction (``model.contract``). Assembly
sizes the KV pools from ``kv_windows`` (per attention layer, in order, its sliding window: the
one place a model's window size is held; the layers' KV views are placed from it,
``models.kv_layout``), the recurrent pool from ``recurrent``, the sampler from ``vocab_size``;
the TTS front end and the frame step read ``rows``; ``rope`` says how cached keys could move
(position-independent reuse), ``selective_recompute`` whether its forward can recompute
part of reused KV (``models.blend``) and ``stack`` what a one-operator decoder stack needs of it
(``models.cpu.decoder_stack``; None: its layers run one by one). Nothing downstream probes a
model for attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hyloop.models.kv_layout import KVView
from hyloop.models.layers.attention import PagedAttention
from hyloop.models.layers.rope import RopeSpec


@dataclass(frozen=True)
class RecurrentLayers:
    """Recurrent (Gated DeltaNet) layers: one state slot holds all of them."""

    num_layers: int
    temporal_shape: tuple[int, ...]
    conv_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class RowLayout:
    """Multi-channel rows: channel 0 is a text id, the rest codebook ids."""

    channel_vocab_sizes: tuple[int, ...]
    end_id: int  # channel 0 of the row that ends a sequence

    @property
    def channels(self) -> int:
        return len(self.channel_vocab_sizes)


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as a decoder stack reads it: its four projections (whatever module
    holds each weight now: packed, quantized or plain), its norm weights (input, post-attention,
    then the per-head q and k norms where the model has them) and its KV pool layer."""

    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    norms: tuple[torch.Tensor, ...]
    kv_layer: int


@dataclass(frozen=True)
class DecoderStackSpec:
    """A dense pre-norm decoder (RMSNorm, RoPE, GQA attention, gated SiLU MLP, residuals) as one
    decoder stack runs it; ``layers`` is read when the stack is built (after packing)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    scale: float  # attention's softmax scale
    rotary_dim: int
    mlp_bias: bool
    rotary: nn.Module  # its cos / sin tables
    embed: nn.Module  # the token embedding: the dtype and device the layers run in
    layers: Callable[[], list[StackLayer]]


@dataclass(frozen=True)
class ModelContract:
    kv_windows: tuple[int | None, ...]  # per attention layer: its sliding window, or None
    kv_heads: int
    head_dim: int
    vocab_size: int  # the widest distribution the step samples from
    max_positions: int
    rope: RopeSpec | None = None
    recurrent: RecurrentLayers | None = None
    rows: RowLayout | None = None
    selective_recompute: bool = False
    stack: DecoderStackSpec | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (one size per model), if any."""
        windows = {w for w in self.kv_windows if w is not None}
        if len(windows) > 1:
            raise ValueError(f"sliding windows {sorted(windows)}: one size per model expected")
        return windows.pop() if windows else None


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def place_kv_layers(
    model: nn.Module, windows: Sequence[int | None], own_pool: bool
) -> tuple[int, int]:
    """Give each attention layer of ``model`` (in order; ``windows``: the contract's
    ``kv_windows``) its view: with ``own_pool`` the sliding-window layers live in the
    sliding-window pool and the full pool holds the rest. Returns the layer counts of (full
    pool, sliding-window pool)."""
    layers = attention_layers(model)
    if len(layers) != len(windows):
        raise ValueError(f"{len(windows)} kv_windows for {len(layers)} attention layers")
    counts = [0, 0]
    for attn, window in zip(layers, windows, strict=True):
        apart = int(own_pool and window is not None)
        attn.view = KVView(counts[apart], window, bool(apart))
        counts[apart] += 1
    return counts[0], counts[1]


def contract_of(
    model: nn.Module,
    *,
    vocab_size: int,
    max_positions: int,
    rope: RopeSpec | None = None,
    recurrent: RecurrentLayers | None = None,
    rows: RowLayout | None = None,
    selective_recompute: bool = False,
    kv_windows: Sequence[int | None] | None = None,
    stack: DecoderStackSpec | None = None,
) -> ModelContract:
    """The contract of ``model`` from its attention layers (``kv_windows``: each one's sliding
    window, None: every layer sees all keys before it); places their views in one full pool."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no attention layer")
    windows = tuple(kv_windows) if kv_windows is not None else (None,) * len(layers)
    place_kv_layers(model, windows, own_pool=False)
    return ModelContract(
        kv_windows=windows,
        kv_heads=layers[0].num_kv_heads,
        head_dim=layers[0].head_dim,
        vocab_size=vocab_size,
        max_positions=max_positions,
        rope=rope,
        recurrent=recurrent,
        rows=rows,
        selective_recompute=selective_recompute,
        stack=stack,
    )
