"""What speculation can give at most on this machine: the measured cost of a verified draft,
and the speedup of a policy that knew in advance which drafts would be kept.

For each batch size, one engine with ``speculative_config`` (the default config's backend, the
shipped GGUF; ``adaptive: false``, so that every match is verified and the verify steps span
every draft count, where the cost model would stop drafting) runs a wave of each workload of
``bench/speculative.py`` twice (a warm-up, then the measured wave) and records every decode
step's wall time at the full batch. From those:

- a plain step's time (median), and a verify step's time as ``plain + fixed + per_draft * d``
  (least squares over the verify steps, ``d`` the drafts they checked): ``per_draft`` over a
  plain step's time per row is **c**, what one verified draft costs in plain tokens;
- the measured wave's greedy outputs, replayed through the same n-gram drafter: an **oracle**
  policy verifies at each step exactly the drafts that will be kept (never a rejected one), so
  a step makes ``1 + kept`` tokens for ``1 + c * kept`` plain steps' time, the fixed part left
  out: no policy with these drafts at this cost a draft does better, so it bounds what any
  can reach; ``every draft`` verifies all of them and pays the fixed part too (what the engine
  with ``adaptive: false`` did in the measured wave, replayed).

The table names the CPU; ``--json`` writes every figure.

    python bench/speculative_bound.py [--batches 1,16] [--workloads rag,code,chat] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout
sys.path.insert(0, str(BENCH))
importlib.import_module("hyloop")  # before torch: OpenMP's passive waits

from common import machine_record, parse_batches, write_json  # noqa: E402
from speculative import WORKLOADS  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402
from hyloop.speculative.policy import NgramDrafter  # noqa: E402


def fit(steps: list[tuple[bool, int, float]]) -> dict[str, float]:
    """``steps``: (verify, drafts, seconds) at one batch size -> plain, fixed and per-draft s."""
    plain = statistics.median(s for v, _, s in steps if not v)
    xs = [(d, s - plain) for v, d, s in steps if v and d]
    if len(xs) < 3:
        raise RuntimeError("fewer than 3 verify steps at the full batch: too few n-gram matches")
    mx, my = statistics.fmean(d for d, _ in xs), statistics.fmean(y for _, y in xs)
    var = sum((d - mx) ** 2 for d, _ in xs)
    slope = sum((d - mx) * (y - my) for d, y in xs) / var if var else my / mx
    return {"plain_s": plain, "per_draft_s": slope, "fixed_s": max(0.0, my - slope * mx)}


def replay(
    prompt: list[int], out: list[int], k: int, lo: int, hi: int, c: float, f: float, oracle: bool
) -> tuple[float, float, int]:
    """One request's greedy output with its drafts: (tokens, cost in plain steps, steps)."""
    drafter = NgramDrafter(lo, hi)
    i, tokens, cost, steps = 0, 0, 0.0, 0
    while i < len(out):
        room = min(k, len(out) - i - 1)
        p = drafter.propose(prompt + out[:i], room) if room > 0 else []
        kept = 0
        while kept < len(p) and p[kept] == out[i + kept]:
            kept += 1
        d = kept if oracle else len(p)
        cost += 1 + (c * d + f if d else 0.0)
        i += min(kept, d) + 1
        tokens += min(kept, d) + 1
        steps += 1
    return tokens, cost, steps


def run_batch(batch: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from hyloop.recipes.offline import default_checkpoint

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
        "adaptive": False,
    }
    ov = [
        f"graphs.backend={args.backend}",
        "model.max_context=2048",
        f"scheduler.max_running_requests={batch}",
        "cache.enable=false",
    ]
    llm = LLM(model=default_checkpoint(), overrides=ov, speculative_config=spec)
    recorder = llm.engine.recorder
    timed = recorder.on_decode
    steps: list[tuple[bool, int, float]] = []

    def record(b: Any, seconds: float) -> None:
        if len(b.chunks) == batch:
            steps.append((b.verify, sum(len(c.drafts) for c in b.chunks), seconds))
        if timed is not None:
            timed(b, seconds)

    recorder.on_decode = record
    rows = []
    try:
        for name in args.workloads.split(","):
            messages = [WORKLOADS[name](i) for i in range(max(batch, args.requests))]
            params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
            llm.chat(messages, params, use_tqdm=False)  # warm-up: captures, the cost model
            steps.clear()
            outs = llm.chat(messages, params, use_tqdm=False)
            costs = fit(steps)
            c = costs["per_draft_s"] / (costs["plain_s"] / batch)
            f = costs["fixed_s"] / costs["plain_s"]
            row: dict[str, Any] = {"workload": name, "batch": batch, **costs, "c": c, "f": f}
            for label, oracle in (("oracle", True), ("every_draft", False)):
                t = cost = n = 0.0
                for o in outs:
                    a, b, s = replay(
                        list(o.prompt_token_ids), list(o.outputs[0].token_ids),
                        args.k, args.lookup_min, args.lookup_max, c, 0.0 if oracle else f, oracle,
                    )  # fmt: skip
                    t, cost, n = t + a, cost + b, n + s
                row[f"{label}_speedup"] = t / cost
                row[f"{label}_tokens_per_step"] = t / n
            rows.append(row)
            print(
                f"  {name} b{batch}: c {c:.2f}, fixed {f:.2f}; oracle "
                f"{row['oracle_speedup']:.2f}x, every draft {row['every_draft_speedup']:.2f}x",
                file=sys.stderr,
            )
    finally:
        llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--workloads", default="rag,code,chat")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--lookup-max", type=int, default=6)
    parser.add_argument("--lookup-min", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = parse_batches(parser, args.batches)
    machine = machine_record()
    print(f"CPU: {machine['cpu_model']}, {machine['cpus']} cpus, torch {machine['torch']}")
    rows = [r for b in batches for r in run_batch(b, args)]
    print(f"\nSmolLM2-135M-Instruct q4_1 (shipped GGUF), {args.backend}, greedy, k={args.k}")
    print(
        "| workload | batch | plain step ms | ms a draft | fixed ms | c | oracle | "
        "oracle tokens / step | every draft |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['batch']} | {1e3 * r['plain_s']:.1f} | "
            f"{1e3 * r['per_draft_s']:.2f} | {1e3 * r['fixed_s']:.1f} | {r['c']:.2f} | "
            f"{r['oracle_speedup']:.2f} | {r['oracle_tokens_per_step']:.2f} | "
            f"{r['every_draft_speedup']:.2f} |"
        )
    write_json({"bench": "speculative_bound", "args": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
