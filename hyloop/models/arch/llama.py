"""Dense decoder-only transformers: Llama (SmolLM2 included), Qwen2 and Qwen3.

One class covers the family; the differences are config flags: Qwen2 adds a q/k/v bias, Qwen3
adds per-head q/k RMSNorm and an explicit ``head_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyloop.graphs.context import StepContext
from hyloop.models.arch.base import DecoderLM
from hyloop.models.layers.attention import PagedAttention
from hyloop.models.layers.mlp import GatedMLP
from hyloop.models.layers.norm import RMSNorm
from hyloop.models.layers.rope import RopeSpec, RotaryEmbedding
from hyloop.models.registry import register, text_config


@dataclass(frozen=True)
class DenseSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DenseSpec:
        cfg = text_config(hf)
        arch = (hf.get("architectures") or [""])[0]
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; expected 'silu'")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = cfg.get("sliding_window")
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        if (
            window
            and cfg.get("use_sliding_window", arch == "MistralForCausalLM")
            and window < max_pos
        ):
            raise ValueError(
                f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window "
                "attention layers are not supported by the dense engine"
            )
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeSpec.from_hf(cfg, head_dim),
            max_positions=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attn_bias,
            o_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


class Attention(nn.Module):
    def __init__(self, spec: DenseSpec, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias)
        self.qkv_proj.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(
            layer_id, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5
        )

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, ctx.positions, ctx.scratch)
        return self.o_proj(self.attn(q, k, v, ctx))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DenseSpec, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    def __init__(self, spec: DenseSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        rotary = RotaryEmbedding(spec.rope, spec.max_positions)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, rotary) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


@register("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
class DenseCausalLM(DecoderLM):
    """``forward(ctx) -> hidden [B, T, H]``; ``compute_logits(hidden [N, H]) -> fp32 [N, V]``."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.spec = DenseSpec.from_hf(hf_config)
        self.model = DecoderBody(self.spec)
        self.lm_head = nn.Linear(self.spec.hidden_size, self.spec.vocab_size, bias=False)
        self.tie_weights()
        self.num_kv_layers = self.spec.num_layers
        self.kv_heads = self.spec.num_kv_heads
        self.head_dim = self.spec.head_dim
