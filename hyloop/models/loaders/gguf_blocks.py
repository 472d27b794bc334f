"""A GGUF tensor kept as its file's quantized blocks, and the 4-bit ones decoded without loss.

Q4_0, Q4_1 and Q4_K all store, for every 32 weights along a row, 4-bit codes and an affine map
``weight = code * scale + min``: Q4_0 ``scale = d, min = -8 d``; Q4_1 ``scale = d, min = m``;
Q4_K (256-weight super-blocks of eight 32-weight sub-blocks with 6-bit scales and mins)
``scale = d * sc_j, min = -dmin * m_j``. ``int4_groups`` returns exactly those codes and maps
(``Int4Groups``), so an int4 kernel with groups of 32 reads the file's own values; Q8_0's int8
codes and per-32 scales come out as they are (``int8_rows``). The other block types (Q5_*,
Q6_K, ...) are requantized from their dequantized values (``models.quant``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from hyloop.models.quant.formats import Int4Groups, Int8Rows

_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [B, 32 j], scale [B, j], min [B, j]


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Gemma's layer norms: llama.cpp's ``ffn_norm`` is the pre-feedforward norm there.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def hf_tensor_name(gguf_name: str, gemma_norms: bool) -> str | None:
    """The HF name of a llama.cpp tensor (``blk.{i}.attn_q.weight`` ->
    ``model.layers.{i}.self_attn.q_proj.weight``); None: no such tensor in an HF checkpoint."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if gemma_norms else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: rows (head, pair, 2) go back to (head, 2, half) order."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[B, c, 32]`` bytes -> ``[B, 2c, 32]`` codes: each 32-byte run's low nibbles, then high."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(qs.shape[0], -1, 32)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)  # [B, 1]


def _q4_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    qs = blocks[:, 2:].reshape(-1, 1, 16)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return codes.reshape(-1, 32), d, -8 * d


def _q4_1(blocks: np.ndarray) -> _Decoded:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    qs = blocks[:, 4:].reshape(-1, 1, 16)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return codes.reshape(-1, 32), d, m


def _q4_k(blocks: np.ndarray) -> _Decoded:
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    codes = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))
    scale = d * sc.astype(np.float32)
    low = -(dmin * m.astype(np.float32))
    return codes.reshape(codes.shape[0], -1), scale, low


INT4_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], _Decoded]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
}

DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class GGUFBlocks:
    """One quantized tensor of a GGUF file: its type, its raw blocks (a view of the file's
    memory map), its HF shape ``[out, in]`` and, for llama's q/k, the heads whose rows the
    converter permuted (0: none)."""

    name: str
    qtype: GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, int]
    permute_heads: int = 0

    @property
    def is_int4(self) -> bool:
        """Whether ``int4_groups`` converts it without loss."""
        return self.qtype in INT4_DECODERS

    @property
    def is_int8(self) -> bool:
        """Whether ``int8_rows`` converts it without loss (Q8_0: 32 int8 codes and an fp16
        scale per block)."""
        return self.qtype == GGMLQuantizationType.Q8_0

    def int8_rows(self) -> Int8Rows:
        """A Q8_0 tensor's own int8 codes and per-32 scales, rows in HF order."""
        if not self.is_int8:
            raise ValueError(f"GGUF tensor {self.name!r} is {self.qtype.name}, not Q8_0")
        blocks = np.ascontiguousarray(self.data).reshape(-1, GGML_QUANT_SIZES[self.qtype][1])
        n, k = self.shape
        scale = torch.from_numpy(_f16(blocks[:, :2])).reshape(n, k // 32)
        codes = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).reshape(n, k)
        if self.permute_heads:
            h = self.permute_heads
            return Int8Rows(
                unpermute_rope_rows(codes, h).contiguous(),
                unpermute_rope_rows(scale, h).contiguous(),
            )
        return Int8Rows(codes, scale)

    def int4_groups(self) -> Int4Groups:
        """The file's own 4-bit codes and per-32 affine maps, rows in HF order."""
        decode = INT4_DECODERS.get(self.qtype)
        if decode is None:
            raise ValueError(
                f"GGUF tensor {self.name!r} is {self.qtype.name}; only "
                f"{sorted(t.name for t in INT4_DECODERS)} hold 4-bit codes"
            )
        _, size = GGML_QUANT_SIZES[self.qtype]
        codes, scale, low = decode(np.ascontiguousarray(self.data).reshape(-1, size))
        n, k = self.shape
        groups = Int4Groups(
            torch.from_numpy(np.ascontiguousarray(codes)).reshape(n, k),
            torch.from_numpy(np.ascontiguousarray(scale)).reshape(n, k // 32),
            torch.from_numpy(np.ascontiguousarray(low)).reshape(n, k // 32),
        )
        if not self.permute_heads:
            return groups
        h = self.permute_heads
        return Int4Groups(
            unpermute_rope_rows(groups.codes, h).contiguous(),
            unpermute_rope_rows(groups.scale, h).contiguous(),
            unpermute_rope_rows(groups.min, h).contiguous(),
        )
