"""Load a GGUF checkpoint as an HF-style config, a float32 state dict and a tokenizer.

Undone here: quantized tensors (dequantized to float32; their blocks are kept beside, as
``GGUFBlocks``, for ``model.weights`` to keep them quantized), llama.cpp's tensor names
(`blk.{i}.attn_q` -> `model.layers.{i}.self_attn.q_proj`), and for llama the converter's permuted
q/k rows (rotary pairs side by side for its interleaved rope), which HF's rotate-half rope needs in
original order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import Tokenizer

from hyloop.models.loaders import gguf_tokenizer as gguf_tok
from hyloop.models.loaders.gguf_blocks import (
    DENSE_TYPES,
    GGUFBlocks,
    hf_tensor_name,
    unpermute_rope_rows,
)


@dataclass(frozen=True)
class _ArchSpec:
    hf_architecture: str
    # llama.cpp permutes Q/K rows only for models it runs with interleaved (non-NeoX) rope.
    permute_qk: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Gemma: four norms per layer, and llama.cpp stores every norm weight as ``1 + w``.
    gemma_norms: bool = False


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("LlamaForCausalLM", permute_qk=True),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": _ArchSpec("Qwen3ForCausalLM", qk_norm=True),
    "gemma3": _ArchSpec("Gemma3ForCausalLM", qk_norm=True, gemma_norms=True),
}

# What llama.cpp assumes for a gemma3 file and does not store (its src/models/gemma3.cpp).
_GEMMA3_FIXED = {
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6,
}

_ROPE_TYPES = ("none", "linear", "yarn")


@dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, in the shapes and names the HF loaders produce."""

    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None  # None only when the file has no tokenizer metadata at all
    add_bos_token: bool = False
    chat_template: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    special_token_ids: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, GGUFBlocks] = field(default_factory=dict)  # HF name -> quantized blocks


class _ArrayReader(GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map (no copy): slicing an
    ``np.memmap`` per metadata value dominated parsing a tokenizer's vocabulary."""

    def _get(self, *args: Any, **kwargs: Any) -> Any:
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(*args, **kwargs)


def _open(path: str | os.PathLike[str]) -> GGUFReader:
    where = f"GGUF checkpoint {os.fspath(path)!r}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist")
    reader = _ArrayReader if hasattr(GGUFReader, "_get") else GGUFReader
    try:
        return reader(path)
    except Exception as exc:  # the reader parses untrusted bytes; any failure means a bad file
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ValueError(f"{where} is not a GGUF file (no b'GGUF' magic)") from exc
        raise ValueError(
            f"{where} ({os.path.getsize(path)} bytes) is truncated or corrupt (an interrupted "
            f"download or copy?); the reader said: {exc}"
        ) from exc


def read_gguf_file_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of a GGUF file, no tensor read (a tokenizer needs nothing more)."""
    return read_gguf_metadata(_open(path))


def read_gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file as plain Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _meta_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}; expected an integer")
    if isinstance(value, list):
        # Some converters write per-layer lists; hyloop's dense models need one value.
        if len(set(value)) != 1:
            raise ValueError(f"GGUF metadata {key!r} is {value!r}; expected one for all layers")
        value = value[0]
    return int(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"GGUF metadata {arch}.rope.scaling.type is {kind!r}; expected one of {_ROPE_TYPES}"
        )
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
    }
    optional = {
        "rope.scaling.original_context_length": ("original_max_position_embeddings", int),
        "rope.scaling.yarn_beta_fast": ("beta_fast", float),
        "rope.scaling.yarn_beta_slow": ("beta_slow", float),
        "rope.scaling.attn_factor": ("attention_factor", float),
    }
    for suffix, (name, cast) in optional.items():
        if f"{arch}.{suffix}" in meta:
            scaling[name] = cast(meta[f"{arch}.{suffix}"])
    return scaling


def _build_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    hidden = _meta_int(meta, f"{arch}.embedding_length")
    heads = _meta_int(meta, f"{arch}.attention.head_count")
    kv_heads = _meta_int(meta, f"{arch}.attention.head_count_kv", heads)
    head_dim = _meta_int(meta, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count {rope_dim} != head_dim {head_dim}")
    eps_key = f"{arch}.attention.layer_norm_rms_epsilon"
    if eps_key not in meta:
        raise ValueError(f"GGUF metadata lacks {eps_key!r}; expected a float")
    config: dict[str, Any] = {
        "architectures": [_ARCHS[arch].hf_architecture],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta_int(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta[eps_key]),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),  # llama.cpp's default
        "max_position_embeddings": _meta_int(meta, f"{arch}.context_length"),
        "tie_word_embeddings": tied,
        "bos_token_id": _optional_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _optional_int(meta.get("tokenizer.ggml.eos_token_id")),
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    if _ARCHS[arch].qkv_bias:
        config["attention_bias"] = True
    if arch == "gemma3":
        config |= _GEMMA3_FIXED
        del config["hidden_act"]
        config["model_type"] = "gemma3_text"
        config["query_pre_attn_scalar"] = head_dim
        config["sliding_window"] = _meta_int(meta, f"{arch}.attention.sliding_window")
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    return config


def _expected_shapes(config: dict[str, Any], spec: _ArchSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape ([out, in] for linears) of every tensor the architecture needs."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(config["num_hidden_layers"]):
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q_dim, h),
            "self_attn.k_proj.weight": (kv_dim, h),
            "self_attn.v_proj.weight": (kv_dim, h),
            "self_attn.o_proj.weight": (h, q_dim),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
        }
        if spec.qkv_bias:
            layer |= {"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,)}
            layer |= {"self_attn.v_proj.bias": (kv_dim,)}
        if spec.qk_norm:
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        if spec.gemma_norms:
            layer |= {"pre_feedforward_layernorm.weight": (h,)}
            layer |= {"post_feedforward_layernorm.weight": (h,)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Read a GGUF file into an HF-style config, a float32 HF-named state dict and a tokenizer."""
    reader = _open(path)
    meta = read_gguf_metadata(reader)
    where = f"GGUF checkpoint {os.fspath(path)!r}"
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"{where} has general.architecture {arch!r}; hyloop loads {sorted(_ARCHS)}"
        )
    spec = _ARCHS[arch]

    named = [(hf_tensor_name(tensor.name, spec.gemma_norms), tensor) for tensor in reader.tensors]
    by_hf_name = {hf_name: tensor for hf_name, tensor in named if hf_name is not None}
    unexpected = [tensor.name for hf_name, tensor in named if hf_name is None]
    embed = by_hf_name.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError(f"{where} lacks tensor 'token_embd.weight'")
    vocab_size = int(embed.shape[-1])  # GGUF lists dims fastest-first: [hidden, vocab]
    if f"{arch}.vocab_size" in meta and int(meta[f"{arch}.vocab_size"]) != vocab_size:
        raise ValueError(
            f"GGUF metadata {arch}.vocab_size is {meta[f'{arch}.vocab_size']}; expected "
            f"{vocab_size}, the rows of token_embd.weight"
        )
    config = _build_config(meta, arch, vocab_size, tied="lm_head.weight" not in by_hf_name)

    expected = _expected_shapes(config, spec)
    unexpected += [by_hf_name[n].name for n in by_hf_name if n not in expected]
    missing = [name for name in expected if name not in by_hf_name]
    if unexpected or missing:
        raise ValueError(
            f"{where} does not match architecture {arch!r}: "
            f"unexpected tensors {sorted(unexpected)}, missing tensors {missing}"
        )
    misshaped = [
        f"{tensor.name} {tuple(int(d) for d in reversed(tensor.shape))} (expected {expected[n]})"
        for n, tensor in by_hf_name.items()
        if tuple(int(d) for d in reversed(tensor.shape)) != expected[n]
    ]
    if misshaped:
        raise ValueError(f"{where} has mis-shaped tensors: {misshaped}")

    state_dict: dict[str, torch.Tensor] = {}
    blocks: dict[str, GGUFBlocks] = {}
    for name in expected:
        tensor = by_hf_name[name]
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:  # unquantized tensors come back as read-only file maps
            array = array.copy()
        weight = torch.from_numpy(array.astype(np.float32, copy=False)).reshape(expected[name])
        heads = 0
        if spec.permute_qk and name.endswith("self_attn.q_proj.weight"):
            heads = config["num_attention_heads"]
        elif spec.permute_qk and name.endswith("self_attn.k_proj.weight"):
            heads = config["num_key_value_heads"]
        elif spec.gemma_norms and name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp stored 1 + w; hyloop's norm scales by 1 + w
        if heads:
            weight = unpermute_rope_rows(weight, heads)
        state_dict[name] = weight.contiguous()
        if tensor.tensor_type not in DENSE_TYPES and len(expected[name]) == 2:
            shape = (expected[name][0], expected[name][1])
            blocks[name] = GGUFBlocks(tensor.name, tensor.tensor_type, tensor.data, shape, heads)
    return GGUFCheckpoint(
        config=config,
        state_dict=state_dict,
        tokenizer=gguf_tok.build_gguf_tokenizer(meta) if gguf_tok.has_tokenizer(meta) else None,
        add_bos_token=gguf_tok.add_bos_token(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=gguf_tok.eos_token_ids(meta),
        special_token_ids=gguf_tok.special_token_ids(meta),
        blocks=blocks,
    )
