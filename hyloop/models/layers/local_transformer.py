"""The per-frame depth ("local") transformer of MOSS-TTS-Local-style models.

Pre-LayerNorm GPT-2 blocks over at most ``max_positions`` local positions (one per channel of a
frame): fused biased ``c_attn`` (q, k, v stacked on output rows), interleaved-pair RoPE, causal
attention, ``fc_out(act(fc_in(x)))``, final ``ln_f``; names match the checkpoint's
``local_transformer.*``. A frame's KV is fixed-shape scratch (``new_cache``), and ``pos`` is a
Python int unrolled by the caller, so every shape is static and nothing reads the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("silu", "swish", "gelu_new")

# Per layer (keys, values), each [B, max_positions, heads, head_dim].
LocalKV = list[tuple[torch.Tensor, torch.Tensor]]


class LocalAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)


class LocalMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"local activation {activation!r}: expected one of {ACTIVATIONS}")
        self.fc_in = nn.Linear(hidden, inner)
        self.fc_out = nn.Linear(inner, hidden)
        self.gelu = activation == "gelu_new"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        h = F.gelu(h, approximate="tanh") if self.gelu else F.silu(h)
        return self.fc_out(h)


class LocalBlock(nn.Module):
    def __init__(self, hidden: int, inner: int, eps: float, activation: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = LocalAttention(hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = LocalMLP(hidden, inner, activation)


class LocalTransformer(nn.Module):
    """``step(x [B, H], pos, cache) -> [B, H]``: one local position for the whole batch."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        inner: int,
        num_layers: int,
        max_positions: int,
        rope_base: float,
        eps: float,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"local hidden {hidden} is not a multiple of n_head {num_heads}")
        self.hidden = hidden
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        if self.head_dim % 2:
            raise ValueError(f"local head_dim {self.head_dim} must be even for RoPE pairs")
        self.max_positions = max_positions
        self.rope_base = rope_base
        self.h = nn.ModuleList(
            LocalBlock(hidden, inner, eps, activation) for _ in range(num_layers)
        )
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        shape = (max_positions, self.head_dim)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.rope_cos.is_meta:
            return
        with torch.device("cpu"):
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
            inv_freq = 1.0 / (self.rope_base**exponent)
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        # Interleaved pairs: channels 2i and 2i+1 share frequency i.
        self.rope_cos.copy_(freqs.cos().repeat_interleave(2, dim=-1))
        self.rope_sin.copy_(freqs.sin().repeat_interleave(2, dim=-1))

    def new_cache(self, batch: int, like: torch.Tensor) -> LocalKV:
        """Uninitialised per-frame K/V: ``step`` writes a position before any read of it."""
        shape = (batch, self.max_positions, self.num_heads, self.head_dim)
        return [(like.new_empty(shape), like.new_empty(shape)) for _ in self.h]

    def step(self, x: torch.Tensor, pos: int, cache: LocalKV, compute: Any) -> torch.Tensor:
        """Position ``pos`` for the batch, attending over ``0..pos`` with ``compute.local``."""
        b, nh, hd = x.shape[0], self.num_heads, self.head_dim
        cos = self.rope_cos[pos].to(x.dtype)
        sin = self.rope_sin[pos].to(x.dtype)
        for block, (k_cache, v_cache) in zip(self.h, cache, strict=True):
            q, k, v = block.attn.c_attn(block.ln_1(x)).view(b, 3, nh, hd).unbind(1)
            q = q * cos + _rotate_pairs(q) * sin
            k = k * cos + _rotate_pairs(k) * sin
            k_cache[:, pos] = k
            v_cache[:, pos] = v
            out = compute.local(q, k_cache, v_cache, pos)
            x = x + block.attn.c_proj(out)
            x = x + block.mlp(block.ln_2(x))
        return self.ln_f(x)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
