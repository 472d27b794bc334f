"""Architecture registry: HF ``model_type`` or ``architectures[0]`` -> hyloop model class.

A class registered for a ``model_type`` wins whatever ``architectures`` says (checkpoint
families whose architecture names vary between releases).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

ARCHITECTURES: dict[str, type[nn.Module]] = {}
MODEL_TYPES: dict[str, type[nn.Module]] = {}


def register(
    *names: str, model_types: tuple[str, ...] = ()
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            ARCHITECTURES[name] = cls
        for model_type in model_types:
            MODEL_TYPES[model_type] = cls
        return cls

    return wrap


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The text-model fields, flattening a nested ``text_config`` (VL-style checkpoints)."""
    nested = hf_config.get("text_config")
    if isinstance(nested, dict):
        merged = {k: v for k, v in hf_config.items() if k != "text_config"}
        merged.update(nested)
        return merged
    return dict(hf_config)


@dataclass(frozen=True)
class DecoderSpec:
    """The sizes every decoder-only architecture here reads alike from its HF config
    (``decoder_sizes``); each architecture's spec adds its own."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool


def decoder_sizes(cfg: dict[str, Any], max_positions: int, tied: bool) -> dict[str, Any]:
    """``DecoderSpec``'s fields from a text config; ``max_positions`` and ``tied``: the
    architecture's defaults for ``max_position_embeddings`` and ``tie_word_embeddings``."""
    heads = int(cfg["num_attention_heads"])
    return {
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "num_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_positions": int(cfg.get("max_position_embeddings", max_positions)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", tied)),
    }


def architecture_of(hf_config: dict[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
    return str(archs[0])


def model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    # Import for registration side effects.
    from hyloop.models import arch  # noqa: F401

    model_type = hf_config.get("model_type")
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    name = architecture_of(hf_config)
    if name not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[name]
