"""Plumbing the bench scripts share: the bandwidth probe, list arguments, the JSON record."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def read_bandwidth(device: torch.device | str = "cpu", gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s of a streaming read: best of ``reps`` sums over a ``gib`` GiB fp32 tensor."""
    device = torch.device(device)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    x.sum()  # fault the pages in / warm the kernel
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def test_helpers() -> Any:
    """``tests/conftest.py`` (the tiny-checkpoint builders) without its thread setting.

    The tests pin torch to one intra-op thread when conftest is imported; a bench that builds
    its checkpoints with it keeps the thread count it had.
    """
    threads = torch.get_num_threads()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import conftest

    torch.set_num_threads(threads)
    return conftest


def parse_batches(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``"1,16"`` -> ``[1, 16]``; a bad list is a usage error naming ``--batches``."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        parser.error(f"--batches: {text!r} is not a comma-separated list of ints")
    if any(b < 1 for b in batches):
        parser.error(f"--batches: {batches} must all be >= 1")
    return batches


def write_json(result: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
