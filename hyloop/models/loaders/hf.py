"""HF-layout checkpoints: ``config.json`` plus single or sharded ``*.safetensors``.

Never downloads: a path that is not a local directory is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def read_hf_config(ckpt: Path) -> dict[str, Any]:
    cfg_path = ckpt / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt}: no config.json")
    return read_json(cfg_path)


def safetensors_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        files = [ckpt / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(
                f"checkpoint {ckpt}: shards listed in the index are missing: {absent}"
            )
        return files
    single = ckpt / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {ckpt}: no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, fh.get_tensor(name)


def eos_ids_from(ckpt: Path, hf_config: dict[str, Any]) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json (then its text_config)."""
    gen = ckpt / "generation_config.json"
    sources = [read_json(gen)] if gen.is_file() else []
    for src in [*sources, hf_config, hf_config.get("text_config") or {}]:
        value = src.get("eos_token_id")
        if value is None:
            continue
        ids = [int(v) for v in value] if isinstance(value, list) else [int(value)]
        if ids:
            return ids
    return []
