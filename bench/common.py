"""Plumbing the bench scripts share: the bandwidth probe, list arguments, the JSON record."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

# The benches' small random dense model (a Llama without its architecture keys): big enough that
# prefill and cache hits show in the timings, small enough to build in a second.
SMALL_DENSE: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    eos_token_id=2,
)

# SmolLM2-135M's shape (its config.json), random weights: the same step cost where the GGUF
# cannot travel (a GPU machine that reaches no package index).
SMOLLM2_SHAPE: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    initializer_range=0.041666666666666664,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


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


def time_hf_generate(hf: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """HF ``generate()`` on equal-length prompts (no padding), greedy, EOS ignored.

    Returns ``gen_s`` (seconds for ``new_tokens`` tokens), ``decode_s`` (``t(N) - t(1)``, the
    decode-only time; None when timing noise exceeds it) and the generated ``token_ids``. Each
    length is timed best-of-a-few after a warm-up: one slow call would skew the difference.
    """
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    pad = hf.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def gen(n: int) -> tuple[float, torch.Tensor]:
        gc.collect()  # keep an earlier run's garbage collection out of the timing
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
            )
        _sync(device)
        return time.perf_counter() - t0, out

    gen(min(4, new_tokens))  # warm-up
    t1 = min(gen(1)[0] for _ in range(3))
    tn, out = gen(new_tokens)
    tn = min(tn, gen(new_tokens)[0])
    token_ids = out[:, ids.shape[1] :].tolist()
    if any(len(g) != new_tokens for g in token_ids):
        raise RuntimeError(f"transformers produced {[len(g) for g in token_ids]} tokens")
    return {"gen_s": tn, "decode_s": tn - t1 if tn > t1 else None, "token_ids": token_ids}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def cpu_name() -> str:
    """The CPU's model name (speed figures differ by CPU: every table names it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def lscpu_fields() -> dict[str, str]:
    """``lscpu``'s ``Key: value`` lines (empty where lscpu is missing or fails)."""
    try:
        text = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(lscpu: dict[str, str] | None = None) -> str:
    """The CPU's feature flags, space-separated: lscpu's ``Flags``, else /proc/cpuinfo's."""
    flags = (lscpu if lscpu is not None else lscpu_fields()).get("Flags")
    if flags is None:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1]
                    break
        except OSError:
            pass
    return " ".join((flags or "").split())


def machine_record() -> dict[str, Any]:
    """What a speed figure depends on: CPU model and flags (AVX-512, AMX...), torch, threads."""
    lscpu = lscpu_fields()
    return {
        "cpu_model": lscpu.get("Model name") or cpu_name(),
        "cpu_vendor": lscpu.get("Vendor ID"),
        "cpu_flags": cpu_flags(lscpu),
        "cpus": os.cpu_count(),
        "arch": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


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
    """Every bench's JSON record, with the ``machine`` it ran on (see ``machine_record``)."""
    if path:
        result = {**result, "machine": machine_record()}
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
