"""Dense decoder-only transformers: Llama (SmolLM2 included), Qwen2 and Qwen3; and what every
decoder-only causal LM here shares (``DecoderLM``: embeddings in, layers, norm, LM head out; the
attention block ``QKVAttention`` and the SwiGLU ``GatedMLP``).

One class covers the family; the differences are config flags: Qwen2 adds a q/k/v bias, Qwen3
adds per-head q/k RMSNorm and an explicit ``head_dim``. Another architecture's model subclasses
``DecoderLM``: it builds ``self.spec`` (with ``tie_word_embeddings``), ``self.model`` (with
``embed_tokens``, ``layers`` and ``norm``) and ``self.lm_head``, calls ``tie_weights()`` and sets
``self.contract`` (``models.contract.contract_of``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.blend import blend_forward
from hyloop.models.contract import DecoderStackSpec, ModelContract, StackLayer, contract_of
from hyloop.models.cpu import numerics  # noqa: F401  (defines hyloop::silu)
from hyloop.models.layers.attention import PagedAttention
from hyloop.models.layers.norm import RMSNorm
from hyloop.models.layers.rope import RopeSpec, RotaryEmbedding
from hyloop.models.registry import DecoderSpec, decoder_sizes, register, text_config
from hyloop.models.weights import StackedParam


@dataclass(frozen=True)
class DenseSpec(DecoderSpec):
    intermediate_size: int
    num_layers: int
    rope: RopeSpec
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DenseSpec:
        cfg = text_config(hf)
        arch = (hf.get("architectures") or [""])[0]
        sizes = decoder_sizes(cfg, max_positions=4096, tied=False)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; expected 'silu'")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window, max_pos = cfg.get("sliding_window"), sizes["max_positions"]
        sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
        if window and sliding and window < max_pos:
            raise ValueError(
                f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window "
                "attention layers are not supported by the dense engine"
            )
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            **sizes,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            rope=RopeSpec.from_hf(cfg, sizes["head_dim"]),
            qkv_bias=is_qwen2 or attn_bias,
            o_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


class DecoderLM(nn.Module):
    """``forward(batch) -> hidden [B, T, H]``; ``compute_logits(hidden [N, H]) -> fp32 [N, V]``."""

    spec: object
    contract: ModelContract
    model: nn.Module
    lm_head: nn.Linear
    stacked_params = (
        StackedParam("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        StackedParam("gate_up_proj", ("gate_proj", "up_proj")),
    )

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:  # type: ignore[attr-defined]
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        if self.spec.tie_word_embeddings:  # type: ignore[attr-defined]
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.blend is not None:  # a prefill over reused KV (``contract.selective_recompute``)
            return blend_forward(self.model, batch)
        x = self.embed(batch.input_ids)
        # A decode or verify step: every layer in one call where the compute path has a
        # decoder stack (``models.cpu.DecoderStack``). Prefill chunks never (one-token ones
        # included): a prompt's tokens always run the layers, so how a prefill is chunked
        # changes no row.
        decode = batch.is_decode or batch.verify
        stack = getattr(batch.pools.compute, "stack", None) if decode else None
        if stack is not None:  # every row count (each row computed with the layers' panels)
            return stack(x, batch)
        for layer in self.model.layers:
            x = layer(x, batch)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(
        self, hidden: torch.Tensor, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``live`` (bool ``[N]``): rows whose logits are wanted (a verify step's real
        positions); a head that can skip rows leaves the others' zeros."""
        return head_rows(self.lm_head, self.model.norm(hidden), live).float()


def head_rows(head: nn.Module, x: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``head(x)``, the rows ``live`` leaves out not computed where the head can skip them
    (``skips_rows``: hyloop's panels)."""
    if live is not None and getattr(head, "skips_rows", False):
        return head(x, live=live)
    return head(x)


class QKVAttention(nn.Module):
    """``qkv_proj`` holds ``[q; k; v]`` stacked on rows (``gated``: each head's ``[q_h | gate_h]``
    for Qwen3-Next's ``attn * sigmoid(gate)``); ``qk_norm`` is a per-head RMSNorm of q and k,
    ``plain`` (Qwen3) or ``zero_centered`` (Gemma 3, Qwen3-Next). The scale defaults to
    ``head_dim ** -0.5``; which keys a query sees is the layer's KV view (the model contract's,
    ``models.kv_layout``)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        *,
        eps: float = 1e-6,
        scale: float | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Literal["plain", "zero_centered"] | None = None,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.gated = gated
        sizes = ((2 if gated else 1) * self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = nn.Linear(hidden, sum(sizes), bias=qkv_bias)
        self.qkv_proj.shard_sizes = sizes
        self.sizes = list(sizes)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:
            centred = qk_norm == "zero_centered"
            self.q_norm = RMSNorm(head_dim, eps, zero_centered=centred)
            self.k_norm = RMSNorm(head_dim, eps, zero_centered=centred)
        self.rotary = rotary
        self.attn = PagedAttention(num_heads, num_kv_heads, head_dim, scale or head_dim**-0.5)

    @classmethod
    def of(cls, spec: Any, rotary: RotaryEmbedding, **options: Any) -> QKVAttention:
        """The block for an architecture's spec (``hidden_size``, ``num_heads``,
        ``num_kv_heads``, ``head_dim``, ``rms_norm_eps``) and its options."""
        return cls(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            rotary,
            eps=spec.rms_norm_eps,
            **options,
        )

    def queries_keys_values(
        self, x: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``q [B,T,Hq,D]`` and ``k`` rotated, ``v [B,T,Hkv,D]``, and the output gate."""
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, batch)
        return q, k, v, gate

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, gate = self.queries_keys_values(x, batch)
        out = self.attn(q, k, v, batch)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, t, self.q_size))
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SiLU (SwiGLU), or ``gelu`` the tanh-approximated GELU
    (Gemma 3); ``gate_up_proj`` holds ``[gate; up]`` stacked on rows."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool = False, gelu: bool = False
    ) -> None:
        super().__init__()
        self.intermediate, self.gelu = intermediate, gelu
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        # CPU: the SiLU the decoder stack's C++ computes (``models.cpu.numerics``).
        act = torch.ops.hyloop.silu(gate) if gate.device.type == "cpu" else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DenseSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        qk_norm = "plain" if spec.qk_norm else None
        self.self_attn = QKVAttention.of(
            spec, rotary, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=qk_norm
        )
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The token embeddings, the decoder layers (a dense spec's, unless ``layers`` are given)
    and the final norm (``zero_centered``: Gemma's ``1 + w``)."""

    def __init__(
        self, spec: Any, layers: Iterable[nn.Module] | None = None, zero_centered: bool = False
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        if layers is None:
            rotary = RotaryEmbedding(spec.rope, spec.max_positions)
            layers = (DecoderLayer(spec, rotary) for _ in range(spec.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, zero_centered=zero_centered)


@register("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
class DenseCausalLM(DecoderLM):
    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        spec = self.spec = DenseSpec.from_hf(hf_config)
        self.model = DecoderBody(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        attn = self.model.layers[0].self_attn
        stack = DecoderStackSpec(
            hidden_size=spec.hidden_size,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            rms_norm_eps=spec.rms_norm_eps,
            scale=attn.attn.scale,
            rotary_dim=spec.rope.rotary_dim,
            mlp_bias=spec.mlp_bias,
            rotary=attn.rotary,
            embed=self.model.embed_tokens,
            layers=self._stack_layers,
        )
        self.contract = contract_of(
            self,
            vocab_size=spec.vocab_size,
            max_positions=spec.max_positions,
            rope=spec.rope,
            selective_recompute=True,
            stack=stack,
        )

    def _stack_layers(self) -> list[StackLayer]:
        """The layers as a decoder stack reads them (``contract.stack.layers``)."""
        out = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.qk_norm:
                norms += [attn.q_norm.weight, attn.k_norm.weight]
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            out.append(StackLayer(*projections, tuple(norms), attn.attn.view.layer))
        return out
