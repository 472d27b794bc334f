"""Architecture registry: HF ``model_type`` or ``architectures[0]`` -> hyloop model class.

A class registered for a ``model_type`` wins whatever ``architectures`` says (checkpoint
families whose architecture names vary between releases).
"""

from __future__ import annotations

from collections.abc import Callable
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
