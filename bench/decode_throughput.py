"""Decode throughput: hyloop against HF transformers ``generate()`` on the same checkpoint.

Both run greedy over the same prompt token ids (equal-length prompts, so HF needs no padding) and
produce exactly ``--new-tokens`` tokens (hyloop: ``ignore_eos``; HF: ``min_new_tokens``), in fp32
and bf16, at batch 1 and 16. Decode tok/s excludes prefill for both: hyloop's from its engine
counters (tokens of decode steps / time in decode steps), HF's as ``B * (N - 1)`` over
``t(generate N) - t(generate 1)``. End-to-end tok/s (prefill included) is reported beside it.

The table also shows the fraction of each step's floor reached: the larger of reading every
weight once (``weight_bytes / read_bandwidth``, the bandwidth measured in the same run by a torch
``sum`` over 1 GiB on all threads) and the rows' GEMM FLOPs at this machine's GEMM rate (the
model's own Linear shapes at 16 rows through the kernels the engine chose, measured in the same
run). Batch 1 is bound by the first, larger batches approach the second.

    python bench/decode_throughput.py [--quick] [--json PATH] [--model CKPT] [--backend compile]

The captured step is what is measured: ``compile`` (``graphs.backend=auto`` would capture only
what each wave's job pays for and run the rest eagerly).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

# hyloop first: it sets OpenMP's passive waits, which libgomp reads once, when torch loads.
importlib.import_module("hyloop")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import parse_batches, read_bandwidth, time_hf_generate, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheap enough for merchants, students and craftsmen. Within fifty years presses were "
    "running in more than two hundred cities, and the number of books in Europe grew into the "
    "millions. Scholars argued about the effects on religion, science and the spread of news."
)


def make_prompts(llm: LLM, batch: int, length: int) -> list[list[int]]:
    """``batch`` distinct prompts of exactly ``length`` token ids."""
    tok = llm.tokenizer
    if tok is not None:
        ids = list(tok.encode(TEXT))
        while len(ids) < length + batch:
            ids = ids + ids
    else:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, llm.engine.vocab_size, (length + batch,), generator=g).tolist()
    return [ids[i : i + length] for i in range(batch)]


def load_hf(model: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model.is_file() and model.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(model.parent), gguf_file=model.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    return hf.eval()


def run_hyloop(
    llm: LLM, prompts: list[list[int]], new_tokens: int, waves: int = 3
) -> dict[str, Any]:
    """A warm-up wave, then ``waves`` timed waves; the best wave's figures (a shared machine's
    noisy moments only ever slow a wave down)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(4, new_tokens), ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    best: dict[str, Any] = {}
    for _ in range(waves):
        gc.collect()  # earlier garbage is no cost of this loop: keep its collection untimed
        s0 = dict(llm.stats())
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        s1 = llm.stats()
        if any(len(o.outputs[0].token_ids) != new_tokens for o in outs):
            raise RuntimeError(
                f"hyloop produced {[len(o.outputs[0].token_ids) for o in outs]} tokens"
            )
        decode_tokens = s1["decode_tokens"] - s0["decode_tokens"]
        decode_tok_s = decode_tokens / (s1["decode_time"] - s0["decode_time"])
        if decode_tok_s > best.get("decode_tok_s", 0.0):
            best = {
                "decode_tok_s": decode_tok_s,
                "e2e_tok_s": len(prompts) * new_tokens / wall,
                "decode_steps": s1["decode_steps"] - s0["decode_steps"],
                "token_ids": [o.outputs[0].token_ids for o in outs],
            }
    return best


def gemm_rate(model: torch.nn.Module, rows: int = 16) -> float:
    """FLOP/s of this model's own Linear shapes at ``rows`` rows, each through the kernel the
    engine chose for it, weights hot in cache (the compute side of the floor)."""
    shapes: dict[tuple[int, int, torch.dtype], torch.nn.Module] = {}
    for m in model.modules():
        if _is_linear(m):
            shapes.setdefault((m.out_features, m.in_features, m.weight.dtype), m)
    flops = seconds = 0.0
    with torch.inference_mode():
        for (out, inp, dtype), layer in shapes.items():
            x = torch.randn(rows, inp, dtype=dtype)
            for _ in range(3):
                layer(x)
            reps = 20
            t0 = time.perf_counter()
            for _ in range(reps):
                layer(x)
            seconds += (time.perf_counter() - t0) / reps
            flops += 2.0 * rows * out * inp
    return flops / seconds


def linear_params(model: torch.nn.Module) -> int:
    """Weights the decode step multiplies per row (every Linear, the LM head included)."""
    return sum(m.weight.numel() for m in model.modules() if _is_linear(m))


def _is_linear(m: torch.nn.Module) -> bool:
    """An ``nn.Linear`` or a drop-in for one (hyloop's packed Linear)."""
    weight = getattr(m, "weight", None)
    return hasattr(m, "in_features") and isinstance(weight, torch.Tensor) and weight.dim() == 2


def run_hf(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    timed = time_hf_generate(hf, prompts, new_tokens)
    batch = len(prompts)
    decode_s = timed["decode_s"]
    decode = None if decode_s is None else batch * (new_tokens - 1) / decode_s
    if decode is None:
        print(f"warning: HF batch {batch}: generate({new_tokens}) no slower than generate(1)")
    e2e = batch * new_tokens / timed["gen_s"]
    return {"decode_tok_s": decode, "e2e_tok_s": e2e, "token_ids": timed["token_ids"]}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(os.cpu_count() or 1)
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        # Other jobs sharing the cores distort CPU timings several-fold.
        print(f"warning: load average {load_start[0]:.1f} at start; timings are unreliable")
    if args.model:
        model = Path(args.model)
    else:
        from hyloop.recipes.offline import default_checkpoint

        model = default_checkpoint()
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    hf = load_hf(model)
    rows = []
    kernels: dict[str, Any] = {}
    for dtype in args.dtypes:
        hf = hf.to(DTYPES[dtype])
        overrides = [
            f"dtype={dtype}",
            f"graphs.backend={args.backend}",
            f"model.max_context={args.prompt_len + args.new_tokens + 16}",
            "kv_pool.page_size=16",
            f"scheduler.max_running_requests={max(args.batches)}",
            "cache.enable=false",  # every run computes the same prefill
        ]
        with LLM(model=model, overrides=overrides) as llm:
            weight_bytes = int(llm.stats()["weight_bytes"])
            kernels[dtype] = llm.engine.derived.cpu_kernels
            rate = gemm_rate(llm.engine.model)
            flops_per_row = 2.0 * linear_params(llm.engine.model)
            print(f"{dtype}: GEMM rate at 16 rows {rate / 1e9:.0f} GFLOP/s")
            for batch in args.batches:
                prompts = make_prompts(llm, batch, args.prompt_len)
                ours = run_hyloop(llm, prompts, args.new_tokens)
                theirs = run_hf(hf, prompts, args.new_tokens)
                # A step reads every weight once and does the rows' GEMM FLOPs: its floor is
                # the larger of the two times.
                floor_s = max(weight_bytes / bandwidth, flops_per_row * batch / rate)
                row = {
                    "dtype": dtype,
                    "batch": batch,
                    "hyloop_tok_s": ours["decode_tok_s"],
                    "hf_tok_s": theirs["decode_tok_s"],
                    "ratio": _ratio(ours["decode_tok_s"], theirs["decode_tok_s"]),
                    "hyloop_e2e_tok_s": ours["e2e_tok_s"],
                    "hf_e2e_tok_s": theirs["e2e_tok_s"],
                    "weight_bytes": weight_bytes,
                    "greedy_ids_equal": ours["token_ids"] == theirs["token_ids"],
                }
                row["floor_step_s"] = floor_s
                row["gemm_flop_s"] = rate
                row["hyloop_floor_fraction"] = floor_s * ours["decode_tok_s"] / batch
                hf_tok_s = theirs["decode_tok_s"]
                row["hf_floor_fraction"] = floor_s * hf_tok_s / batch if hf_tok_s else None
                rows.append(row)
                print_row(row)
    return {
        "bench": "decode_throughput",
        "model": str(model),
        "backend": args.backend,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "metric": "decode tok/s, prefill excluded for both (end-to-end beside it)",
        "read_bandwidth_bytes_s": bandwidth,
        "threads": torch.get_num_threads(),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "torch": torch.__version__,
        "cpu_kernels": kernels,
        "rows": rows,
    }


HEADER = (
    f"{'dtype':>9} {'batch':>5} {'hyloop tok/s':>12} {'HF tok/s':>9} {'ratio':>6} "
    f"{'floor% hyloop':>13} {'floor% HF':>9} {'same ids':>8}"
)


def print_row(row: dict[str, Any]) -> None:
    if not getattr(print_row, "_header_done", False):
        print(HEADER)
        print_row._header_done = True  # type: ignore[attr-defined]
    floor = row.get("hyloop_floor_fraction")
    floor_hf = row.get("hf_floor_fraction")
    print(
        f"{row['dtype']:>9} {row['batch']:>5} {row['hyloop_tok_s']:>12.1f} "
        f"{_num(row['hf_tok_s'], '.1f'):>9} {_num(row['ratio'], '.2f'):>6} "
        f"{_pct(floor):>13} {_pct(floor_hf):>9} "
        f"{str(row['greedy_ids_equal']):>8}",
        flush=True,
    )


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer new tokens (a smoke run)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--model", help="HF checkpoint dir or .gguf (default: SmolLM2-135M GGUF)")
    p.add_argument("--backend", default="compile", help="hyloop graphs.backend override")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (--quick: 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"--dtypes: {bad} not in {sorted(DTYPES)}")
    args.batches = parse_batches(p, args.batches)
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 64
    if args.new_tokens < 2:
        p.error(f"--new-tokens: {args.new_tokens}; expected >= 2 (one prefill token + decode)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = bench(args)
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
