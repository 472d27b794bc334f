"""Replay of n-gram drafting over greedy outputs: where batch 1's speed-up comes from.

Greedy outputs are the same with speculation on and off, so one run without it gives every
request's tokens, and the engine's drafter (``hyloop.speculative.policy.NgramDrafter``) replays
over them exactly. At each step it proposes from the request's prompt and its output so far; the
target keeps the proposal's prefix that equals the output; the request moves on by that prefix
and one token. Every proposal is verified in full (the engine's policy may verify fewer).

A second run, with speculation on at ``bench/speculative.py``'s settings, times the decode steps
at batch 1 and fits a step's cost: a plain step ``P``, a verify step of ``d`` drafts
``P + F + C d``. With them the replay predicts each drafting setting's on / off at batch 1:
``P * tokens / (P * plain steps + sum over verify steps of (P + F + C d))``. The table gives, per
workload and setting, the share of steps that had a draft, the tokens per step, the predicted
on / off, and the ceiling if verifying cost nothing (``F = C = 0``: tokens per step). A second
table gives, per length of the n-gram a proposal matched, and whether that n-gram occurred once
before or several times, how often its first draft was kept and how many of its drafts were, on
average (what the policy's acceptance by match length learns as it runs, the split aside).

    python bench/speculative_replay.py [--workloads rag,code,chat] [--json F]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # run from a checkout
sys.path.insert(0, str(BENCH))

importlib.import_module("hyloop")  # before torch: OpenMP's passive waits

import torch  # noqa: E402
from common import machine_record, write_json  # noqa: E402
from speculative import WORKLOADS  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402
from hyloop.recipes.offline import default_checkpoint  # noqa: E402
from hyloop.speculative.policy import NgramDrafter  # noqa: E402

# (lookup min, lookup max, drafts): the bench's setting first
SETTINGS = [(3, 6, 8), (2, 6, 8), (1, 6, 8), (3, 12, 8), (4, 8, 8)]
SETTINGS += [(3, 6, 4), (3, 6, 12), (3, 6, 16)]
MATCH_SETTING = (1, 8, 15)  # the per-match-length table: every length from 1 to 8
OVERRIDES = [
    "dtype=float32",
    "model.weights=auto",
    "graphs.backend=auto",
    "model.max_context=2048",
    "cache.enable=false",
]


def outputs(workloads: list[str], requests: int, new_tokens: int) -> dict[str, list[dict]]:
    """Each workload's requests: prompt ids and greedy output ids, without speculation."""
    llm = LLM(
        model=default_checkpoint(), overrides=[*OVERRIDES, "scheduler.max_running_requests=8"]
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    try:
        out = {}
        for name in workloads:
            done = llm.chat([WORKLOADS[name](i) for i in range(requests)], params, use_tqdm=False)
            out[name] = [
                {"prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids)}
                for o in done
            ]
        return out
    finally:
        llm.close()


def step_costs(workload: str, requests: int, new_tokens: int) -> dict[str, float]:
    """Seconds of a plain step (P), of a verify step's fixed part (F) and of a draft (C) at
    batch 1: the least-squares fit of every decode step's time over [1, verifies, drafts]."""
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 6}
    spec["prompt_lookup_min"] = 3
    llm = LLM(
        model=default_checkpoint(),
        overrides=[*OVERRIDES, "scheduler.max_running_requests=1"],
        speculative_config=spec,
    )
    messages = [WORKLOADS[workload](i) for i in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    rows: list[tuple[float, float, float]] = []
    try:
        llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        timed = llm.engine.scheduler.speculator.timed

        def record(batch: Any, seconds: float) -> None:
            drafts = sum(len(c.drafts) for c in batch.chunks)
            rows.append((float(bool(batch.verify)), float(drafts), seconds))
            timed(batch, seconds)

        llm.engine.recorder.on_decode = record
        llm.chat(messages, params, use_tqdm=False)
    finally:
        llm.close()
    a = torch.tensor([[1.0, v, d] for v, d, _ in rows], dtype=torch.float64)
    y = torch.tensor([[s] for *_, s in rows], dtype=torch.float64)
    p, f, c = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    return {"plain_s": p, "fixed_s": f, "per_draft_s": c, "steps": len(rows)}


def proposals(
    requests: list[dict], lo: int, hi: int, k: int
) -> Iterator[tuple[int, bool, int, int]]:
    """The drafter over each request's tokens, one step at a time: the length of the n-gram the
    step's proposal matched (0: none), whether that n-gram occurred once before (not several
    times), its drafts, and how many of them were kept."""
    for r in requests:
        history, output = list(r["prompt"]), r["output"]
        drafter = NgramDrafter(lo, hi)
        pos = 0
        while pos < len(output):
            proposal = drafter.propose(history, min(k, len(output) - pos - 1))
            kept = 0
            while kept < len(proposal) and proposal[kept] == output[pos + kept]:
                kept += 1
            n = drafter.matched
            gram = history[len(history) - n :]
            once = n > 0 and sum(history[t - n : t] == gram for t in range(n, len(history))) == 1
            yield n, once, len(proposal), kept
            history += output[pos : pos + kept + 1]
            pos += kept + 1


def replay(requests: list[dict], lo: int, hi: int, k: int) -> dict[str, float]:
    """The drafter over each request's tokens: steps, those with a draft, drafts, and the
    tokens made."""
    steps = drafting = drafts = 0
    for _, _, drafted, _ in proposals(requests, lo, hi, k):
        steps += 1
        drafting += drafted > 0
        drafts += drafted
    made = sum(len(r["output"]) for r in requests)
    return {"steps": steps, "drafting": drafting, "drafts": drafts, "tokens": made}


def by_match(requests: list[dict], lo: int, hi: int, k: int) -> dict[str, dict[str, float]]:
    """Per length of the n-gram a proposal followed, and whether it occurred once before or
    several times (``"3 once"``, ``"3 repeated"``): the proposals, the share whose first draft
    was kept, and the mean drafts kept (every proposal verified in full)."""
    table: dict[tuple[int, bool], list[int]] = {}
    for matched, once, drafted, kept in proposals(requests, lo, hi, k):
        if drafted:
            row = table.setdefault((matched, once), [0, 0, 0])
            row[0] += 1
            row[1] += kept > 0
            row[2] += kept
    return {
        f"{n} {'once' if once else 'repeated'}": {
            "proposals": c,
            "first_kept": first / c,
            "mean_kept": kept / c,
        }
        for (n, once), (c, first, kept) in sorted(table.items(), key=_match_order)
    }


def _match_order(item: tuple[tuple[int, bool], list[int]]) -> tuple[int, bool]:
    """Match length, then once before the repeated."""
    (n, once), _ = item
    return n, not once


def predicted(rep: dict[str, float], cost: dict[str, float]) -> float:
    """On / off at batch 1 for a replay, under the fitted step costs."""
    p, f, c = cost["plain_s"], cost["fixed_s"], cost["per_draft_s"]
    on = p * rep["steps"] + f * rep["drafting"] + c * rep["drafts"]
    return p * rep["tokens"] / on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="rag,code,chat")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names = args.workloads.split(",")
    for name in names:
        if name not in WORKLOADS:
            parser.error(f"--workloads: {name!r}, expected some of {sorted(WORKLOADS)}")
    machine = machine_record()
    print(f"CPU: {machine['cpu_model']}, {machine['cpus']} cpus, torch {machine['torch']}")
    tokens = outputs(names, args.requests, args.new_tokens)
    cost = step_costs(names[0], args.requests, args.new_tokens)
    print(
        f"step costs at batch 1 ({names[0]}, {cost['steps']} steps): plain "
        f"{1e3 * cost['plain_s']:.2f} ms, a verify step's fixed part {1e3 * cost['fixed_s']:.2f} "
        f"ms, a draft {1e3 * cost['per_draft_s']:.3f} ms"
    )
    rows = []
    for name in names:
        for lo, hi, k in SETTINGS:
            rep = replay(tokens[name], lo, hi, k)
            rows.append(
                {
                    "workload": name,
                    "lookup_min": lo,
                    "lookup_max": hi,
                    "k": k,
                    **rep,
                    "drafting_share": rep["drafting"] / rep["steps"],
                    "tokens_per_step": rep["tokens"] / rep["steps"],
                    "predicted_ratio": predicted(rep, cost),
                }
            )
    print(
        "\nSmolLM2-135M-Instruct Q4_1 GGUF (model.weights=auto, graphs.backend=auto), greedy, "
        f"{args.requests} requests a workload, up to {args.new_tokens} new tokens; batch 1"
    )
    print("| workload | lookup | k | steps with a draft | tokens / step | predicted on / off |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['lookup_min']}-{r['lookup_max']} | {r['k']} | "
            f"{100 * r['drafting_share']:.0f} % | {r['tokens_per_step']:.2f} | "
            f"{r['predicted_ratio']:.2f} |"
        )
    lo, hi, k = MATCH_SETTING
    print(
        f"\nBy the length of the n-gram a proposal matched (lookups {lo}-{hi}, up to {k} drafts, "
        "every proposal verified)"
    )
    print("| workload | match | proposals | first draft kept | mean drafts kept |")
    print("|---|---|---:|---:|---:|")
    matches = {}
    for name in names:
        matches[name] = by_match(tokens[name], lo, hi, k)
        for n, m in matches[name].items():
            print(
                f"| {name} | {n} | {m['proposals']} | {100 * m['first_kept']:.0f} % | "
                f"{m['mean_kept']:.1f} |"
            )
    write_json(
        {
            "bench": "speculative_replay",
            "args": vars(args),
            "cost": cost,
            "rows": rows,
            "by_match": matches,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
