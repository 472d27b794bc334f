"""Map checkpoint tensors (HF names) onto a hyloop module, strictly.

Fused parameters (``qkv_proj``, ``gate_up_proj``) are filled shard by shard from their HF parts.
Every parameter must be filled exactly once and every checkpoint tensor must land somewhere:
missing, unexpected or mis-shaped tensors raise one error that names each of them once. A model
may rename a checkpoint tensor (``rename_weight``; None drops it) and adapt its value to the
parameter's layout (``adapt_weight``, e.g. dropping rows the model never reads).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

# Tensors some checkpoints carry that are derived, not learned.
IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"), re.compile(r"^mtp\."))


@dataclass(frozen=True)
class StackedParam:
    """``fused`` holds ``parts`` concatenated along dim 0, e.g. qkv_proj <- q/k/v_proj."""

    fused: str
    parts: tuple[str, ...]


class WeightLoadError(ValueError):
    pass


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    source: str = "checkpoint",
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied: dict[str, str] = getattr(model, "tied_weights", {})
    stacked: tuple[StackedParam, ...] = getattr(model, "stacked_params", ())
    rename = getattr(model, "rename_weight", None)
    adapt = getattr(model, "adapt_weight", None)
    filled: dict[str, int] = {}  # param name -> rows filled
    unexpected: list[str] = []
    misshaped: list[str] = []
    wrong: set[str] = set()  # named once, as mis-shaped, never again as missing
    plan = _stack_plan(model, params, stacked)

    for name, tensor in weights:
        if any(p.match(name) for p in IGNORED):
            continue
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if adapt is not None:
            tensor = adapt(name, tensor)
        if name in tied:
            target = params[tied[name]]
            if tuple(tensor.shape) != tuple(target.shape):
                misshaped.append(f"{name}: {tuple(tensor.shape)} vs {tuple(target.shape)}")
            continue  # tied copies carry no extra information
        hit = _stacked_target(name, stacked)
        pname = name if hit is None else hit[0]
        if pname not in params:
            unexpected.append(name)
            continue
        if hit is None:
            dst = params[pname].data
            rows = _rows(dst)
        else:  # this part's rows of the fused parameter
            start, rows = plan[pname][hit[1]]
            dst = params[pname].data.narrow(0, start, rows)
        if tuple(tensor.shape) != tuple(dst.shape):
            misshaped.append(f"{name}: {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            wrong.add(pname)
            continue
        dst.copy_(tensor)
        filled[pname] = filled.get(pname, 0) + rows

    missing = [
        n
        for n, p in params.items()
        if n not in tied and n not in wrong and filled.get(n, 0) != _rows(p)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(sorted(missing))}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if misshaped:
        problems.append(f"mis-shaped tensors: {'; '.join(misshaped)}")
    if problems:
        raise WeightLoadError(f"{source}: " + " | ".join(problems))


def _rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def _stacked_target(name: str, stacked: tuple[StackedParam, ...]) -> tuple[str, int] | None:
    for sp in stacked:
        for i, part in enumerate(sp.parts):
            token = f".{part}."
            if token in name:
                return name.replace(token, f".{sp.fused}."), i
    return None


def _stack_plan(
    model: nn.Module, params: dict[str, nn.Parameter], stacked: tuple[StackedParam, ...]
) -> dict[str, list[tuple[int, int]]]:
    """Row ranges of each part inside each fused parameter.

    The fused module declares its parts' row counts as ``shard_sizes`` (e.g. q, k, v sizes);
    without it the rows split evenly.
    """
    plan: dict[str, list[tuple[int, int]]] = {}
    for pname, p in params.items():
        for sp in stacked:
            if f".{sp.fused}." not in pname:
                continue
            owner = model.get_submodule(pname.rsplit(".", 1)[0])
            sizes = list(getattr(owner, "shard_sizes", []))
            if not sizes:
                n = len(sp.parts)
                if p.shape[0] % n:
                    raise WeightLoadError(f"{pname}: {p.shape[0]} rows do not split in {n}")
                sizes = [p.shape[0] // n] * n
            plan[pname] = [(sum(sizes[:i]), rows) for i, rows in enumerate(sizes)]
    return plan
