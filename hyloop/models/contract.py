"""What an architecture tells assembly: the pools it needs, its positions, its row layout.

Every model class builds a ``ModelContract`` at construction (``model.contract``). Assembly
sizes the KV pools from ``kv_layers`` (one entry per attention layer, in order, with its
window), the recurrent pool from ``recurrent``, the sampler from ``vocab_size``; the TTS front
end and the frame step read ``rows``; ``rope`` says how cached keys could move (position-
independent reuse) and ``selective_recompute`` whether its forward can recompute part of reused KV
(``models.blend``). Nothing downstream probes a model for attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hyloop.models.layers.attention import PagedAttention, place_kv_layers
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

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (one size per model), if any."""
        windows = {w for w in self.kv_windows if w is not None}
        if len(windows) > 1:
            raise ValueError(f"sliding windows {sorted(windows)}: one size per model expected")
        return windows.pop() if windows else None


def contract_of(
    model: nn.Module,
    *,
    vocab_size: int,
    max_positions: int,
    rope: RopeSpec | None = None,
    recurrent: RecurrentLayers | None = None,
    rows: RowLayout | None = None,
    selective_recompute: bool = False,
) -> ModelContract:
    """The contract of ``model`` from its attention layers (numbered into one full pool)."""
    layers: Sequence[PagedAttention] = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no attention layer")
    place_kv_layers(model, swa_pool=False)
    return ModelContract(
        kv_windows=tuple(a.window for a in layers),
        kv_heads=layers[0].num_kv_heads,
        head_dim=layers[0].head_dim,
        vocab_size=vocab_size,
        max_positions=max_positions,
        rope=rope,
        recurrent=recurrent,
        rows=rows,
        selective_recompute=selective_recompute,
    )
