"""Hybrid Qwen3-Next / Qwen3.5: Gated DeltaNet layers interleaved with gated full attention.

Both families share the layer stack: zero-centred ``(1 + w)`` RMSNorms, full-attention layers
whose ``q_proj`` also emits a per-head output gate (``attn * sigmoid(gate)``), q/k norms and
partial RoPE. Qwen3-Next packs the GDN projections per key-head group and uses a sparse MoE with
a gated shared expert; Qwen3.5 has split GDN projections and a dense SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyloop.graphs.context import StepContext
from hyloop.models.arch.base import DecoderLM
from hyloop.models.layers.attention import PagedAttention
from hyloop.models.layers.gdn import GatedDeltaNet, GDNDims
from hyloop.models.layers.mlp import GatedMLP
from hyloop.models.layers.norm import RMSNorm
from hyloop.models.layers.rope import RopeSpec, RotaryEmbedding
from hyloop.models.registry import register, text_config
from hyloop.pools.recurrent_pool import RecurrentPool
from hyloop.pools.step_fence import StepFence

LINEAR, FULL = "linear_attention", "full_attention"


def _layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    bad = sorted({t for t in types} - {LINEAR, FULL})
    if len(types) != n or bad:
        raise ValueError(
            f"layer_types {types}: expected {n} entries of {LINEAR!r} / {FULL!r} (bad: {bad})"
        )
    return tuple(types)


@dataclass(frozen=True)
class HybridSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    sparse_layers: tuple[bool, ...]  # per layer: sparse MoE (Qwen3-Next) instead of dense MLP
    gdn: GDNDims
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any], moe: bool) -> HybridSpec:
        cfg = text_config(hf)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; expected 'silu'")
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        types = _layer_types(cfg)
        experts = int(cfg.get("num_experts", 0)) if moe else 0
        step = int(cfg.get("decoder_sparse_step", 1))
        dense_only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(
            i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(len(types))
        )
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeSpec.from_hf(cfg, head_dim),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_types=types,
            sparse_layers=sparse,
            gdn=GDNDims.from_config(cfg, interleaved_proj=moe),
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 0)) if moe else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)) if moe else 0,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0))
            if moe
            else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate from ``q_proj``."""

    def __init__(self, spec: HybridSpec, kv_layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # q_proj rows hold [q_h | gate_h] per head, hence twice the query size.
        sizes = (2 * self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(sizes), bias=spec.attention_bias)
        self.qkv_proj.shard_sizes = sizes
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.attention_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, zero_centered=True)
        self.rotary = rotary
        self.attn = PagedAttention(
            kv_layer, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5
        )

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, t, _ = x.shape
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = qg.view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim))
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, ctx.positions, ctx.scratch)
        out = self.attn(q, k, v, ctx) * torch.sigmoid(gate.reshape(b, t, self.q_size))
        return self.o_proj(out)


class SparseMoE(nn.Module):
    """Top-k routed experts (softmax in fp32, optional renormalisation) + gated shared expert.

    Every expert runs on every token and unrouted ones get weight 0: shapes stay static for
    capture, at the cost of ``num_experts / top_k`` more expert FLOPs than a grouped kernel.
    """

    def __init__(self, spec: HybridSpec) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(spec.hidden_size, spec.moe_intermediate_size) for _ in range(spec.num_experts)
        )
        self.shared_expert = GatedMLP(spec.hidden_size, spec.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        top_w, top_i = F.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        weights = torch.zeros_like(logits).scatter(1, top_i, top_w.to(logits.dtype))
        out = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        for e, expert in enumerate(self.experts):
            out = out + weights[:, e : e + 1] * expert(flat)
        return out.view_as(x)


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, spec: HybridSpec, layer_idx: int, mixer_idx: int, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        eps = spec.rms_norm_eps
        self.is_linear = spec.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(spec.gdn, layer_idx, recurrent_idx=mixer_idx)
        else:
            self.self_attn = GatedAttention(spec, mixer_idx, rotary)
        if spec.sparse_layers[layer_idx]:
            self.mlp: nn.Module = SparseMoE(spec)
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, zero_centered=True)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, ctx) if self.is_linear else self.self_attn(h, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridBody(nn.Module):
    def __init__(self, spec: HybridSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        rotary = RotaryEmbedding(spec.rope, spec.max_positions)
        layers, counts = [], {LINEAR: 0, FULL: 0}
        for i, kind in enumerate(spec.layer_types):
            # KV layers and recurrent layers are numbered separately: each pool holds only its own.
            layers.append(HybridDecoderLayer(spec, i, counts[kind], rotary))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, zero_centered=True)


class HybridCausalLM(DecoderLM):
    """``forward(ctx) -> hidden [B, T, H]``; ``compute_logits(hidden [N, H]) -> fp32 [N, V]``.

    Needs a KV pool of ``num_kv_layers`` layers and a recurrent pool of
    ``num_recurrent_layers`` layers (``new_recurrent_pool`` sizes one).
    """

    moe = False

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.spec = HybridSpec.from_hf(hf_config, moe=self.moe)
        self.model = HybridBody(self.spec)
        self.lm_head = nn.Linear(self.spec.hidden_size, self.spec.vocab_size, bias=False)
        self.tie_weights()
        self.num_kv_layers = self.spec.layer_types.count(FULL)
        self.num_recurrent_layers = self.spec.layer_types.count(LINEAR)
        self.kv_heads = self.spec.num_kv_heads
        self.head_dim = self.spec.head_dim

    def rename_weight(self, name: str) -> str | None:
        """VL checkpoints keep the text model under ``model.language_model``; vision is skipped."""
        if name.startswith("model.visual."):
            return None
        return name.replace("model.language_model.", "model.", 1)

    def new_recurrent_pool(
        self,
        num_slots: int,
        device: torch.device | str,
        conv_dtype: torch.dtype = torch.float32,
        fence: StepFence | None = None,
    ) -> RecurrentPool:
        """A pool for this model's recurrent layers; the temporal state is always fp32."""
        d = self.spec.gdn
        return RecurrentPool(
            self.num_recurrent_layers,
            num_slots,
            d.temporal_shape,
            d.conv_dim,
            d.conv_kernel,
            conv_dtype=conv_dtype,
            device=device,
            fence=fence,
        )


@register("Qwen3NextForCausalLM")
class Qwen3NextForCausalLM(HybridCausalLM):
    moe = True


@register("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
class Qwen3_5ForCausalLM(HybridCausalLM):
    moe = False
