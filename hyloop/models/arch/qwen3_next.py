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

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.arch.llama import DecoderBody, DecoderLM, GatedMLP, QKVAttention
from hyloop.models.contract import RecurrentLayers, contract_of
from hyloop.models.layers.gdn import GatedDeltaNet, GDNDims
from hyloop.models.layers.norm import RMSNorm
from hyloop.models.layers.rope import RopeSpec, RotaryEmbedding
from hyloop.models.registry import DecoderSpec, decoder_sizes, register, text_config

LINEAR, FULL = "linear_attention", "full_attention"


def _layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    bad = sorted(set(types) - {LINEAR, FULL})
    if len(types) != n or bad:
        raise ValueError(
            f"layer_types {types}: expected {n} entries of {LINEAR!r} / {FULL!r} (bad: {bad})"
        )
    return tuple(types)


@dataclass(frozen=True)
class HybridSpec(DecoderSpec):
    intermediate_size: int
    rope: RopeSpec
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
        sizes = decoder_sizes(cfg, max_positions=4096, tied=False)
        types = _layer_types(cfg)
        moe_cfg = cfg if moe else {}  # a dense model reads no MoE sizes
        experts = int(moe_cfg.get("num_experts", 0))
        step = int(cfg.get("decoder_sparse_step", 1))
        dense_only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(
            i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(len(types))
        )
        return cls(
            **sizes,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            rope=RopeSpec.from_hf(cfg, sizes["head_dim"]),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_types=types,
            sparse_layers=sparse,
            gdn=GDNDims.from_config(cfg, interleaved_proj=moe),
            num_experts=experts,
            top_k=int(moe_cfg.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(moe_cfg.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(moe_cfg.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )


class SparseMoE(nn.Module):
    """Top-k routed experts (fp32 softmax, optional renormalisation) + a gated shared expert.
    Every expert runs on every token, unrouted ones weighted 0: shapes stay static for capture,
    at ``num_experts / top_k`` times a grouped kernel's expert FLOPs."""

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
        self, spec: HybridSpec, layer_idx: int, recurrent_idx: int, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        eps = spec.rms_norm_eps
        self.is_linear = spec.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(spec.gdn, layer_idx, recurrent_idx)
        else:
            bias = spec.attention_bias
            self.self_attn = QKVAttention.of(
                spec, rotary, qkv_bias=bias, o_bias=bias, qk_norm="zero_centered", gated=True
            )
        if spec.sparse_layers[layer_idx]:
            self.mlp: nn.Module = SparseMoE(spec)
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, zero_centered=True)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, batch) if self.is_linear else self.self_attn(h, batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridCausalLM(DecoderLM):
    """GDN layers keep their state in the recurrent pool (``contract.recurrent``)."""

    moe = False

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        spec = self.spec = HybridSpec.from_hf(hf_config, moe=self.moe)
        rotary = RotaryEmbedding(spec.rope, spec.max_positions)
        # Recurrent layers are numbered apart: the recurrent pool holds only theirs.
        index = [spec.layer_types[:i].count(LINEAR) for i in range(len(spec.layer_types))]
        layers = (HybridDecoderLayer(spec, i, r, rotary) for i, r in enumerate(index))
        self.model = DecoderBody(spec, layers, zero_centered=True)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        d = spec.gdn
        recurrent = RecurrentLayers(
            spec.layer_types.count(LINEAR), d.temporal_shape, d.conv_dim, d.conv_kernel
        )
        self.contract = contract_of(
            self,
            vocab_size=spec.vocab_size,
            max_positions=spec.max_positions,
            rope=spec.rope,
            recurrent=recurrent,
        )

    def rename_weight(self, name: str) -> str | None:
        """VL checkpoints keep the text model under ``model.language_model``; vision is skipped."""
        if name.startswith("model.visual."):
            return None
        return name.replace("model.language_model.", "model.", 1)


@register("Qwen3NextForCausalLM")
class Qwen3NextForCausalLM(HybridCausalLM):
    moe = True


@register("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
class Qwen3_5ForCausalLM(HybridCausalLM):
    moe = False
