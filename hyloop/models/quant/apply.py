"""``model.weights``: which Linears of a loaded model run on weight-only int4 / int8 kernels.

- ``dequantize``: every weight dense, in the model's dtype (the oracle the others are held to);
- ``auto``: a GGUF file's quantized Linears stay quantized where a kernel runs them: 4-bit
  blocks (Q4_0, Q4_1, Q4_K) as int4 with the file's own codes (no loss), Q8_0 blocks as int8 with
  the file's own codes and block scales (no loss), every other quantized type (Q5_*, Q6_K, ...)
  as per-channel int8 requantized from its values (more bits than the file held); dense
  tensors, HF checkpoints and devices without the kernels stay dense;
- ``int8`` / ``int4``: every large Linear so, requantized round-to-nearest where the file did not
  hold that format (an HF checkpoint too; Q8_0 blocks stay as they are under ``int8``).

A fused projection (``qkv_proj``, ``gate_up_proj``) is quantized as one: under ``auto`` it is int4
only when all its parts were 4-bit in the file. A tied LM head reads the embedding's blocks (the
embedding itself stays dense: a lookup reads only a few rows). Shapes a kernel cannot take stay
dense and are counted.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from hyloop.models.cpu.panels import gate_up_split
from hyloop.models.quant.formats import (
    INT4_GROUP,
    Int4Groups,
    Int8Rows,
    int4_from_dense,
    int8_from_dense,
)
from hyloop.models.quant.linear import (
    Int4Linear,
    Int8Linear,
    int4_supported,
    int8_supported,
    kernels_available,
)

if TYPE_CHECKING:
    from hyloop.models.loaders.gguf_blocks import GGUFBlocks

log = logging.getLogger(__name__)

WeightsMode = Literal["auto", "dequantize", "int8", "int4"]
WEIGHT_MODES: tuple[str, ...] = ("auto", "dequantize", "int8", "int4")

# Below this many weights a Linear costs little to stream and stays dense (as for packing).
MIN_QUANTIZED_WEIGHTS = 1 << 16


def _parts(prefix: str, linear: nn.Linear, model: nn.Module) -> list[tuple[str, int]]:
    """The checkpoint weights (HF names) that fill ``linear``, with their row counts."""
    parent, _, leaf = prefix.rpartition(".")
    for sp in getattr(model, "stacked_params", ()):
        if leaf == sp.fused:
            n = len(sp.parts)
            sizes = list(getattr(linear, "shard_sizes", [linear.out_features // n] * n))
            return [
                (f"{parent}.{part}.weight", rows)
                for part, rows in zip(sp.parts, sizes, strict=True)
            ]
    return [(f"{prefix}.weight", linear.out_features)]


def _format(
    mode: str, sources: list[GGUFBlocks | None], n: int, k: int
) -> Literal["int4", "int8"] | None:
    if mode == "auto":
        if any(s is None for s in sources):
            return None  # dense in the checkpoint: stays dense
        wanted = "int4" if all(s is not None and s.is_int4 for s in sources) else "int8"
    else:
        wanted = "int4" if mode == "int4" else "int8"
    if wanted == "int4" and int4_supported(n, k, INT4_GROUP):
        return "int4"
    if wanted == "int8" and int8_supported(n, k):
        return "int8"
    return None


def _int4_groups(
    linear: nn.Linear, parts: list[tuple[str, int]], sources: list[GGUFBlocks | None]
) -> Int4Groups:
    pieces, start = [], 0
    for (_, rows), src in zip(parts, sources, strict=True):
        if src is not None and src.is_int4:
            pieces.append(src.int4_groups())  # the file's own codes
        else:
            pieces.append(int4_from_dense(linear.weight[start : start + rows]))
        start += rows
    return Int4Groups.cat(pieces)


def _int8_rows(
    linear: nn.Linear, parts: list[tuple[str, int]], sources: list[GGUFBlocks | None]
) -> Int8Rows:
    if all(src is None or not src.is_int8 for src in sources):
        return int8_from_dense(linear.weight)
    pieces, start = [], 0
    for (_, rows), src in zip(parts, sources, strict=True):
        if src is not None and src.is_int8:
            pieces.append(src.int8_rows())  # the file's own codes and block scales
        else:
            pieces.append(int8_from_dense(linear.weight[start : start + rows]))
        start += rows
    return Int8Rows.cat(pieces)


def quantize_linears(
    model: nn.Module,
    mode: str,
    blocks: Mapping[str, GGUFBlocks],
    device: torch.device,
    source: str = "checkpoint",
) -> dict[str, int]:
    """Swap ``model``'s Linears for ``Int4Linear`` / ``Int8Linear`` as ``mode`` says; returns how
    many Linears of each format there are (``int4``, ``int8``, ``dense``: left dense)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"model.weights={mode!r}: expected one of {WEIGHT_MODES}")
    if mode == "dequantize":
        return {}
    if not kernels_available(device):
        if mode == "auto":
            return {}
        raise ValueError(
            f"model.weights={mode!r}: weight-only {mode} Linears run on the CPU, not on device "
            f"{device.type!r}; use model.weights=dequantize"
        )
    tied: dict[str, str] = getattr(model, "tied_weights", {})
    counts: Counter[str] = Counter()
    with torch.no_grad():
        for prefix, parent in list(model.named_modules()):
            for leaf, child in list(parent.named_children()):
                if type(child) is not nn.Linear or child.weight.numel() < MIN_QUANTIZED_WEIGHTS:
                    continue
                name = f"{prefix}.{leaf}" if prefix else leaf
                parts = _parts(name, child, model)
                sources = [blocks.get(p, blocks.get(tied.get(p, ""))) for p, _ in parts]
                fmt = _format(mode, sources, child.out_features, child.in_features)
                if fmt is None:
                    counts["dense"] += 1
                    continue
                bias, split = child.bias, gate_up_split(name, child.out_features)
                if fmt == "int4":
                    groups = _int4_groups(child, parts, sources)
                    layer: nn.Module = Int4Linear(groups, bias, split)
                else:
                    layer = Int8Linear(_int8_rows(child, parts, sources), bias, split)
                setattr(parent, leaf, layer)
                counts[fmt] += 1
    log.info("hyloop: %s weights=%s: %s", source, mode, dict(counts))
    return dict(counts)
