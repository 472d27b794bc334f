"""Move cached K/V to new positions: copy V, rotate K by the position delta.

RoPE turns pair ``j`` of a key by ``p * theta_j``; rotations compose, so a key cached at ``p_old``
becomes the key at ``p_new`` after one more turn by ``(p_new - p_old) * theta_j``. That holds for
frequencies independent of the position and the sequence length: the default, linear and Llama-3
scalings; dynamic NTK (a length-dependent base), YaRN's attention factor baked into cos/sin and
multi-axis positions are refused.

The turn is the difference of the two angles as the model's own fp32 table holds them, taken in
fp64 and applied in fp32 whatever the pool's dtype, so the moved key equals the key the model
computes at the new position, rounding of large fp32 angles included. Pair layouts: ``neox``
(``x[i]`` with ``x[i + d/2]``) and ``gptj`` (``x[2i]`` with ``x[2i + 1]``); dimensions past
``rotary_dim`` (partial rotary) are copied unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch

from hyloop.models.contract import ModelContract
from hyloop.models.layers.rope import RopeSpec

SHIFTABLE_ROPE_TYPES = ("default", "linear", "llama3")
Layout = Literal["neox", "gptj"]


def table_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[N, rd/2]`` angles exactly as the model's fp32 cos/sin table has them."""
    return torch.outer(positions.to(torch.float32), inv_freq.to(torch.float32))


def rotate_keys(
    k: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: Layout = "neox",
) -> torch.Tensor:
    """``k [N, H, D]`` computed at ``old_pos [N]`` moved to ``new_pos [N]``, in fp32; the first
    ``2 * len(inv_freq)`` dims rotate."""
    rd = 2 * inv_freq.numel()
    if rd > k.shape[-1]:
        raise ValueError(f"rotary dims {rd} exceed the head dim {k.shape[-1]}")
    if layout == "neox":
        first, second = slice(0, rd // 2), slice(rd // 2, rd)
    elif layout == "gptj":
        first, second = slice(0, rd, 2), slice(1, rd, 2)
    else:
        raise ValueError(f"rope layout {layout!r} is not supported; expected 'neox' or 'gptj'")
    angle = table_angles(new_pos, inv_freq).double() - table_angles(old_pos, inv_freq).double()
    cos = angle.cos().to(torch.float32).unsqueeze(1)  # [N, 1, rd/2]
    sin = angle.sin().to(torch.float32).unsqueeze(1)
    x = k.to(torch.float32)
    out = x.clone()
    a, b = x[..., first], x[..., second]
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


class KVShifter:
    """Copies runs of a KV pool's slots to other slots, moving K by a position delta."""

    def __init__(self, spec: RopeSpec, layout: Layout = "neox") -> None:
        if spec.rope_type not in SHIFTABLE_ROPE_TYPES:
            raise ValueError(
                f"rope_type {spec.rope_type!r} cannot be shifted exactly by a position delta; "
                f"position-independent reuse supports {SHIFTABLE_ROPE_TYPES}"
            )
        self.layout: Layout = layout
        self.inv_freq = spec.inv_freq()

    def copy_shifted(
        self,
        k_layers: list[torch.Tensor],
        v_layers: list[torch.Tensor],
        src: torch.Tensor,
        dst: torch.Tensor,
        old_pos: torch.Tensor,
        new_pos: torch.Tensor,
    ) -> None:
        """Per layer: ``V[dst] = V[src]``; ``K[dst]`` = ``K[src]`` moved to ``new_pos``."""
        if not len(src):
            return
        device = k_layers[0].device
        src, dst = src.to(device, torch.int64), dst.to(device, torch.int64)
        old_pos, new_pos = old_pos.to(device), new_pos.to(device)
        inv_freq = self.inv_freq.to(device)
        for k, v in zip(k_layers, v_layers, strict=True):
            v.index_copy_(0, dst, v.index_select(0, src))
            moved = rotate_keys(k.index_select(0, src), old_pos, new_pos, inv_freq, self.layout)
            k.index_copy_(0, dst, moved.to(k.dtype))


def shifter_for(contract: ModelContract, name: str) -> KVShifter:
    """The shifter for a model's attention (its ``contract``; ``name`` for errors), or a
    ValueError saying why its KV cannot move."""
    if contract.recurrent is not None:
        raise ValueError(
            f"cache.position_independent: {name} has recurrent layers, whose state is not "
            "position-addressable; position-independent reuse needs an attention-only model"
        )
    if contract.sliding_window is not None:
        raise ValueError(
            f"cache.position_independent: {name} has sliding-window layers; reusing their KV "
            "at another offset is not designed yet"
        )
    if contract.rope is None:
        raise ValueError(f"cache.position_independent: {name} has no rotary embedding to shift")
    return KVShifter(contract.rope, "neox")  # hyloop's RotaryEmbedding rotates halves
