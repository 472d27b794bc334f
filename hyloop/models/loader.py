"""Build a hyloop model from a local checkpoint: an HF directory or a GGUF file."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyloop.models.loaders.hf import (
    eos_ids_from,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from hyloop.models.quant import WeightOnlyLinear, quantize_linears
from hyloop.models.registry import model_class
from hyloop.models.tokenizer import TextTokenizer, load_hf_tokenizer
from hyloop.models.weights import load_weights

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: dict[str, Any]
    tokenizer: TextTokenizer | None
    eos_token_ids: list[int] = field(default_factory=list)
    source: str = ""
    quantized: dict[str, int] = field(default_factory=dict)  # Linears per format (model.weights)

    @property
    def weight_bytes(self) -> int:
        first: dict[int, nn.Parameter] = {}
        for p in self.model.parameters():
            first.setdefault(p.data_ptr(), p)  # tensors sharing storage count once
        dense = sum(p.numel() * p.element_size() for p in first.values())
        quantized = (m for m in self.model.modules() if isinstance(m, WeightOnlyLinear))
        return dense + sum(m.nbytes for m in quantized)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, weights: str = "auto"
) -> LoadedModel:
    """Load weights strictly (missing / unexpected / mis-shaped tensors raise); ``weights``
    (``model.weights``) says which Linears stay or become int4 / int8 (``models.quant``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {path} (hyloop never downloads)")
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, dtype, device, weights)
    if not p.is_dir():
        raise ValueError(f"checkpoint {path}: expected an HF directory or a .gguf file")
    hf_config = read_hf_config(p)
    model = _instantiate(hf_config)
    load_weights(model, iter_safetensors(safetensors_files(p)), source=str(p))
    model = model.to(device=device, dtype=dtype).eval()
    counts = quantize_linears(model, weights, {}, device, source=str(p))
    tok, eos = load_hf_tokenizer(p), eos_ids_from(p, hf_config)
    return LoadedModel(model, hf_config, tok, eos, str(p), counts)


def _instantiate(hf_config: dict[str, Any]) -> nn.Module:
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    # Materialise without random init; every parameter is then overwritten by the checkpoint,
    # and derived buffers (RoPE tables) are recomputed by their owners.
    model = model.to_empty(device="cpu")
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # to_empty() may re-create shared parameters separately
    return model


def _load_gguf(p: Path, dtype: torch.dtype, device: torch.device, weights: str) -> LoadedModel:
    from hyloop.models.loaders.gguf import load_gguf

    ckpt = load_gguf(p)
    model = _instantiate(ckpt.config)
    load_weights(model, ckpt.state_dict.items(), source=str(p))
    model = model.to(device=device, dtype=dtype).eval()
    counts = quantize_linears(model, weights, ckpt.blocks, device, source=str(p))
    tok = TextTokenizer(
        ckpt.tokenizer,
        add_bos=ckpt.add_bos_token,
        bos_id=ckpt.config.get("bos_token_id"),
        chat_template=ckpt.chat_template,
    )
    return LoadedModel(model, ckpt.config, tok, list(ckpt.eos_token_ids), str(p), counts)


def load_tokenizer(path: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer alone, as ``load_model`` attaches it, without reading any
    weight (None when the checkpoint ships none)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {path} (hyloop never downloads)")
    if p.is_dir():
        return load_hf_tokenizer(p)
    from hyloop.models.loaders.gguf import read_gguf_file_metadata
    from hyloop.models.loaders.gguf_tokenizer import (
        add_bos_token,
        build_gguf_tokenizer,
        has_tokenizer,
    )

    meta = read_gguf_file_metadata(p)
    if not has_tokenizer(meta):
        return None
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return TextTokenizer(
        build_gguf_tokenizer(meta),
        add_bos=add_bos_token(meta),
        bos_id=None if bos is None else int(bos),
        chat_template=meta.get("tokenizer.chat_template"),
    )


# generation_config.json keys vLLM takes request defaults from, and the field each sets.
GENERATION_CONFIG_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


# transformers' GenerationConfig defaults: a value equal to one is no request default (vLLM
# reads ``GenerationConfig.to_diff_dict()``).
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


def generation_defaults(source: str, model_path: str) -> dict[str, Any]:
    """Request defaults from a ``generation_config.json`` as vLLM applies them: ``source`` is
    ``auto`` (the checkpoint directory's), ``vllm`` (none) or a directory holding one."""
    if source == "vllm" or (source == "auto" and not model_path):
        return {}
    folder = Path(model_path if source == "auto" else source).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise FileNotFoundError(
                f"model.generation_config: no generation_config.json in {folder}"
            )
        return {}
    try:
        gen = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    out: dict[str, Any] = {}
    for key, name in GENERATION_CONFIG_FIELDS.items():
        value = gen.get(key) if isinstance(gen, dict) else None
        if value is None or value == _HF_DEFAULTS.get(key):  # vLLM reads the diff only
            continue
        out[name] = value
    return out
