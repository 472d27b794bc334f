"""Generation controls in the captured step: what they cost a decode step.

SmolLM2 (its GGUF), the compiled step, one bucket of ``--batch`` rows, lookahead on (``--no-
lookahead``: off), all in one run and in alternating waves (a shared machine's slow moments
land on every kind alike; each kind's best wave is reported):

- ``plain``: sampled requests with no control;
- ``controls``: every logits control on every request (repetition, presence and frequency
  penalties, min_p, logit_bias, allowed-token-free bad words, min_tokens);
- ``json``: structured outputs, a JSON schema per request (its masks written by the resolve
  side while the step runs), against ``json_free``: the same prompts and lengths unconstrained.

Decode tok/s is tokens of decode steps over time in decode steps (the engine's counters). The
table also times the controls' own ops on neutral rows at this batch (what a plain request
pays for them inside the captured step), against one step's time.

    python bench/generation_controls.py [--quick] [--json PATH] [--model GGUF]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import cpu_name, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402

TEXT = (
    "Write a short record for a library catalogue. The book is a history of the printing press "
    "in the fifteenth century, when movable type made books cheap enough for merchants and "
    "students, and presses ran in more than two hundred cities within fifty years."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "topics": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "author", "year", "topics"],
}


def kinds(batch: int, new: int) -> dict[str, list[SamplingParams]]:
    def one(i: int, **kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=new, **kw)

    every = dict(
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.2,
        min_p=0.05,
        logit_bias={13: -2.0, 29: 1.5},
        bad_words=["printing press", "Gutenberg"],
        min_tokens=8,
    )
    from hyloop.sampling_params import StructuredOutputsParams

    shaped = StructuredOutputsParams(json=SCHEMA)
    return {
        "plain": [one(i, ignore_eos=True) for i in range(batch)],
        "controls": [one(i, ignore_eos=True, **every) for i in range(batch)],
        "json": [one(i, structured_outputs=shaped) for i in range(batch)],
        "json_free": [one(i) for i in range(batch)],
    }


def wave(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    gc.collect()
    s0 = dict(llm.stats())
    outs = llm.generate(prompts, params, use_tqdm=False)
    s1 = llm.stats()
    tokens = s1["decode_tokens"] - s0["decode_tokens"]
    return {
        "decode_tok_s": tokens / (s1["decode_time"] - s0["decode_time"]),
        "decode_tokens": tokens,
        "fallbacks": s1["eager_fallbacks"] - s0["eager_fallbacks"],
        "recompiles": s1["recompiles"] - s0["recompiles"],
        "texts": [o.outputs[0].text for o in outs],
        "lengths": [len(o.outputs[0].token_ids) for o in outs],
    }


def valid_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)


def neutral_ops_ms(llm: LLM, batch: int, reps: int = 50) -> float:
    """The controls' ops on ``batch`` neutral rows (eager, as a compiled step runs them fused
    into its sampler), in ms per step."""
    from hyloop.graphs.sampler import apply_controls

    kind = llm.llm_engine.kind
    s = kind.pools.requests
    rows = torch.full((batch,), kind.pools.padding_row, dtype=torch.int64)
    logits = torch.randn(batch, kind.vocab_size)
    below = torch.zeros(batch, dtype=torch.bool)

    def ops() -> torch.Tensor:
        x = kind._grammar_mask(logits, s.grammar, rows)
        return apply_controls(
            x, s.bias[rows], s.words[rows], s.recent[rows], s.min_stop[rows], below
        )

    ops()
    t0 = time.perf_counter()
    for _ in range(reps):
        ops()
    return (time.perf_counter() - t0) / reps * 1e3


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from hyloop.recipes.offline import default_checkpoint

    model = Path(args.model) if args.model else default_checkpoint()
    overrides = [
        "graphs.backend=compile",
        f"graphs.buckets=[{args.batch}]",
        f"lookahead.enable={str(args.lookahead).lower()}",
        "lookahead.min_batch=1",
        "model.max_context=512",
    ]
    with LLM(model=model, overrides=overrides) as llm:
        ids = list(llm.tokenizer.encode(TEXT))
        prompts = [
            ids[: args.prompt_len - 1] + [ids[(i * 7) % len(ids)]] for i in range(args.batch)
        ]
        params = kinds(args.batch, args.new_tokens)
        llm.generate(prompts, params["plain"][:], use_tqdm=False)  # capture + warm up
        llm.generate(prompts, params["json"][:], use_tqdm=False)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.waves):
            for name, ps in params.items():
                r = wave(llm, prompts, ps)
                if r["decode_tok_s"] > best.get(name, {}).get("decode_tok_s", 0.0):
                    best[name] = r
        step_ms = 1e3 * args.batch / best["plain"]["decode_tok_s"]
        ops_ms = neutral_ops_ms(llm, args.batch)
    parsed = sum(valid_json(t) for t in best["json"]["texts"])
    return {
        "cpu": cpu_name(),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "lookahead": args.lookahead,
        "kinds": {k: {kk: vv for kk, vv in v.items() if kk != "texts"} for k, v in best.items()},
        "json_valid": f"{parsed}/{args.batch}",
        "json_texts": best["json"]["texts"],
        "step_ms": step_ms,
        "neutral_control_ops_ms": ops_ms,
        "controls_vs_plain": best["controls"]["decode_tok_s"] / best["plain"]["decode_tok_s"],
        "json_vs_free": best["json"]["decode_tok_s"] / best["json_free"]["decode_tok_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF or HF checkpoint (default: SmolLM2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--no-lookahead", dest="lookahead", action="store_false")
    ap.add_argument("--quick", action="store_true", help="2 waves of 32 tokens")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.waves, args.new_tokens = 2, 32
    r = bench(args)
    print(
        f"\nGeneration controls, {r['cpu']}, batch {r['batch']}, compile, "
        f"lookahead {'on' if r['lookahead'] else 'off'}, {r['new_tokens']} new tokens"
    )
    print(f"{'kind':<12}{'decode tok/s':>14}{'tokens':>8}{'fallbacks':>11}{'recompiles':>12}")
    for name, k in r["kinds"].items():
        print(
            f"{name:<12}{k['decode_tok_s']:>14.1f}{k['decode_tokens']:>8}"
            f"{k['fallbacks']:>11}{k['recompiles']:>12}"
        )
    print(f"controls / plain: {r['controls_vs_plain']:.2f}x (goal >= 0.9)")
    print(
        f"json / unconstrained: {r['json_vs_free']:.2f}x (goal >= 0.8); "
        f"valid JSON {r['json_valid']}"
    )
    print(
        f"neutral rows' control ops: {r['neutral_control_ops_ms']:.2f} ms of a "
        f"{r['step_ms']:.1f} ms step"
    )
    write_json(r, args.json)


if __name__ == "__main__":
    main()
