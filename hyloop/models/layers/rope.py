"""Rotary position embeddings as HF configs specify them.

``rope_type`` ``default``, ``linear`` or ``llama3``; ``dynamic`` is refused (its table follows
the sequence length, which a captured step cannot). Reads both transformers 4's top-level
``rope_theta`` / ``rope_scaling`` and 5's ``rope_parameters``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyloop.graphs.step_batch import StepBatch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], head_dim: int) -> RopeSpec:
        params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
            )
        return cls(
            theta=float(theta),
            rotary_dim=int(head_dim * float(partial)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )

    def inv_freq(self) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        inv = 1.0 / (self.theta**exponent)
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = torch.where(medium, smoothed, scaled)
        return inv


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (rotate-half layout)."""

    def __init__(self, spec: RopeSpec, max_positions: int) -> None:
        super().__init__()
        self.spec = spec
        self.max_positions = max_positions
        self.rotary_dim = spec.rotary_dim
        self.register_buffer("cos", torch.empty(max_positions, spec.rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, spec.rotary_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.cos.is_meta:
            return
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(self.max_positions).float(), self.spec.inv_freq())
            emb = torch.cat([freqs, freqs], dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [B,T,Hq,D]`` and ``k [B,T,Hk,D]`` at the step's positions; the gathered
        rows are shared with the other layers through ``batch.meta``."""
        key = ("rope", id(self))
        cs = batch.meta.get(key)
        if cs is None:
            cs = batch.meta[key] = (
                self.cos[batch.positions].unsqueeze(2).to(q.dtype),
                self.sin[batch.positions].unsqueeze(2).to(q.dtype),
            )
        cos, sin = cs
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)
