"""Generation controls in the captured step: what they cost a decode step.

SmolLM2 (its GGUF), the compiled step, one bucket of ``--batch`` rows, lookahead on (``--no-
lookahead``: off), all in one run and in alternating waves (a shared machine's slow moments
land on every kind alike; each kind's best wave is reported):

- ``plain``: sampled requests with no control;
- ``controls``: every logits control on every request (repetition, presence and frequency
  penalties, min_p, logit_bias, allowed-token-free bad words, min_tokens);
- ``json``: structured outputs, a JSON schema per request (its masks written by the resolve
  side while the step runs), against ``json_free``: the same prompts unconstrained, each row
  generating as many tokens as it did in the json wave before it (the same batch shape).

Decode tok/s is tokens of decode steps over time in decode steps (the engine's counters). A batch
with no control runs an artifact captured without the controls' ops (``ArtifactKey.features``),
so plain requests pay nothing for them; the table lists the artifacts each kind ran.

    python bench/generation_controls.py [--quick] [--json PATH] [--model GGUF]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import cpu_name, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402
from hyloop.graphs.capture import ArtifactKey  # noqa: E402

TEXT = (
    "Write a short record for a library catalogue. The book is a history of the printing press "
    "in the fifteenth century, when movable type made books cheap enough for merchants and "
    "students, and presses ran in more than two hundred cities within fifty years."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["title", "author", "year", "topics"],
    "additionalProperties": False,
}
JSON_TOKENS = 160  # enough for every bounded record to close


def kinds(batch: int, new: int) -> dict[str, list[SamplingParams]]:
    def one(i: int, **kw: Any) -> SamplingParams:
        return SamplingParams(**{"temperature": 0.8, "seed": i, "max_tokens": new, **kw})

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

    shaped = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return {
        "plain": [one(i, ignore_eos=True) for i in range(batch)],
        "controls": [one(i, ignore_eos=True, **every) for i in range(batch)],
        "json": [one(i, structured_outputs=shaped, max_tokens=JSON_TOKENS) for i in range(batch)],
        "json_free": [one(i, max_tokens=JSON_TOKENS) for i in range(batch)],
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
        last_json: list[int] = []
        for _ in range(args.waves):
            for name, ps in params.items():
                if name == "json_free":  # the json wave's shape: each row its json length
                    ps = [
                        dataclasses.replace(p, max_tokens=n, ignore_eos=True)
                        for p, n in zip(ps, last_json, strict=True)
                    ]
                r = wave(llm, prompts, ps)
                if name == "json":
                    last_json = r["lengths"]
                if r["decode_tok_s"] > best.get(name, {}).get("decode_tok_s", 0.0):
                    best[name] = r
        captured = [list(k) for k in llm.llm_engine.graphs.runner.stats()["captured"]]
    parsed = sum(valid_json(t) for t in best["json"]["texts"])
    return {
        "cpu": cpu_name(),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "lookahead": args.lookahead,
        "kinds": {k: {kk: vv for kk, vv in v.items() if kk != "texts"} for k, v in best.items()},
        "json_valid": f"{parsed}/{args.batch}",
        "json_texts": best["json"]["texts"],
        "captured": captured,  # (batch, kv_len, top_cap, num_logprobs, features)
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
    for key in sorted(r["captured"]):
        print(f"artifact {ArtifactKey(*key).label()}")
    write_json(r, args.json)


if __name__ == "__main__":
    main()
