"""Gemma 3 (text): local sliding-window layers interleaved with global full-attention layers.

Beyond the Llama family: embeddings scaled by ``sqrt(hidden)``, zero-centred ``(1 + w)`` RMSNorm,
q/k RMSNorm, four norms per layer, a GELU-tanh gated MLP, the attention scale
``query_pre_attn_scalar ** -0.5``, and per-layer ``layer_types``: sliding layers see the last
``sliding_window`` tokens and rotate with ``rope_local_base_freq``, global ones with
``rope_theta`` and its scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.arch.llama import DecoderBody, DecoderLM, GatedMLP, QKVAttention
from hyloop.models.contract import contract_of
from hyloop.models.layers.norm import RMSNorm
from hyloop.models.layers.rope import RopeSpec, RotaryEmbedding
from hyloop.models.registry import DecoderSpec, decoder_sizes, register, text_config

SLIDING = "sliding_attention"
FULL = "full_attention"
DEFAULT_SLIDING_PATTERN = 6  # every sixth layer is global when a config lists no layer_types
DEFAULT_LOCAL_THETA = 10_000.0
DEFAULT_GLOBAL_THETA = 1_000_000.0


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or DEFAULT_SLIDING_PATTERN)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(
            f"layer_types {types!r}: expected {num_layers} entries of {SLIDING!r} or {FULL!r}"
        )
    return tuple(types)


def _rope_specs(cfg: dict[str, Any], head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(sliding, full) RoPE specs from either spelling: per-layer-type ``rope_parameters``
    (transformers 5) or ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` (4)."""
    params = cfg.get("rope_parameters") or {}
    if SLIDING in params or FULL in params:
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), **params}
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_GLOBAL_THETA))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))
    full_spec = RopeSpec.from_hf({"rope_parameters": full}, head_dim)
    local_spec = RopeSpec.from_hf({"rope_parameters": local}, head_dim)
    return local_spec, full_spec


@dataclass(frozen=True)
class Gemma3Spec(DecoderSpec):
    intermediate_size: int
    num_layers: int
    attn_scale: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_local: RopeSpec
    rope_global: RopeSpec
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Gemma3Spec:
        cfg = text_config(hf)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'"
            )
        if cfg.get("attn_logit_softcapping"):
            raise ValueError(
                f"attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported "
                "(Gemma 3 checkpoints have none)"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported (causal LM only)")
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported (Gemma 3 has no q/k/v bias)")
        sizes = decoder_sizes(cfg, max_positions=32768, tied=True)
        head_dim = sizes["head_dim"]
        num_layers = int(cfg["num_hidden_layers"])
        rope_local, rope_global = _rope_specs(cfg, head_dim)
        window = int(cfg.get("sliding_window") or 0)
        if window < 1:
            raise ValueError(f"sliding_window={cfg.get('sliding_window')!r}: expected >= 1")
        softcap = cfg.get("final_logit_softcapping")
        return cls(
            **sizes,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_window=window,
            layer_types=_layer_types(cfg, num_layers),
            rope_local=rope_local,
            rope_global=rope_global,
            final_logit_softcapping=float(softcap) if softcap else None,
        )


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: Gemma3Spec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, zero_centered=True)
        self.self_attn = QKVAttention.of(
            spec, rotary, scale=spec.attn_scale, qk_norm="zero_centered"
        )
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centered=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, zero_centered=True)
        self.mlp = GatedMLP(h, spec.intermediate_size, gelu=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, zero_centered=True)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@register("Gemma3ForCausalLM", model_types=("gemma3_text",))
class Gemma3CausalLM(DecoderLM):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        spec = self.spec = Gemma3Spec.from_hf(hf_config)
        local = RotaryEmbedding(spec.rope_local, spec.max_positions)
        glob = RotaryEmbedding(spec.rope_global, spec.max_positions)
        layers = (
            Gemma3DecoderLayer(spec, local if t == SLIDING else glob) for t in spec.layer_types
        )
        self.model = DecoderBody(spec, layers, zero_centered=True)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        self.embed_scale = math.sqrt(spec.hidden_size)
        # Two RoPE tables (local and global): no one ``RopeSpec`` says how its keys move.
        windows = [spec.sliding_window if t == SLIDING else None for t in spec.layer_types]
        self.contract = contract_of(
            self, vocab_size=spec.vocab_size, max_positions=spec.max_positions, kv_windows=windows
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * x.new_full((), self.embed_scale)  # NOTE: HF rounds the scale to the dtype

    def compute_logits(
        self, hidden: torch.Tensor, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = super().compute_logits(hidden, live)
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
