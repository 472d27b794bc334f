"""Position-independent reuse on SmolLM2: two RAG-shaped workloads, reuse off vs on.

A registration wave puts every document's KV in the cache; the query wave then asks over
several documents behind another system prompt, 16 greedy tokens each (the workloads:
``bench/pi_workloads.py``). Both arms keep the exact-prefix cache on; reuse off serves only the
system prompt from it. Each "on" arm is ``recompute_tokens:recompute_ratio``: the fixed head of
every reused run computed anyway, and the share of the reused tokens selective recompute
computes again (CacheBlend: those whose K/V at the check layer deviates most). Per arm: document
tokens reused (net of those recomputed), reused tokens recomputed, prefill tokens computed, the
query wave's wall and CPU time (this process's: less sensitive to other load) and its speedup
over reuse off in CPU time, and against reuse off the mean / max first-token KL, the share of
queries whose first greedy token is equal, the mean agreeing prefix of the 16 tokens and the
share fully equal. Prints a table per workload with the CPU's name and writes JSON.

    python bench/position_independent.py --json /tmp/pi.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

# hyloop first: it sets OpenMP's passive wait policy before torch loads (``omp_policy``), so
# spinning threads neither burn this process's CPU time nor wait on the machine's other load.
from hyloop import LLM, SamplingParams  # noqa: E402, I001
from hyloop.recipes.offline import default_checkpoint  # noqa: E402

import torch  # noqa: E402
from common import cpu_name, lscpu_fields, write_json  # noqa: E402
from pi_workloads import Workload, modules, reference  # noqa: E402

NEW_TOKENS = 16
WORKLOADS = {"modules": modules, "reference": reference}


def parse_arms(text: str) -> list[tuple[int, float]]:
    """``"16:0,0:0.15"`` -> ``[(16, 0.0), (0, 0.15)]`` (recompute_tokens:recompute_ratio)."""
    arms = []
    for part in text.split(","):
        tokens, _, ratio = part.partition(":")
        arms.append((int(tokens), float(ratio or 0)))
    return arms


def run_arm(
    model: Path, backend: str, weights: str, arm: tuple[int, float] | None, work: Workload
) -> dict[str, Any]:
    overrides = [f"graphs.backend={backend}", f"model.weights={weights}", "kv_pool.num_pages=40000"]
    if arm is not None:
        overrides += [
            "cache.position_independent.enable=true",
            f"cache.position_independent.recompute_tokens={arm[0]}",
            f"cache.position_independent.recompute_ratio={arm[1]}",
        ]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=model, overrides=overrides) as llm:
        llm.generate(
            [work.register[0][:40]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
        )  # warm up
        llm.generate(work.register, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        engine = llm.engine
        engine.capture_logits = True
        before = llm.stats()
        reqs, outs = [], {}
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (prompt, _) in enumerate(work.queries):
            engine.add_request(f"q{i}", prompt, greedy)
            reqs.append(engine.request(f"q{i}"))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        engine.check_invariants()
        after = llm.stats()
    ordered = [outs[f"q{i}"] for i in range(len(work.queries))]
    return {
        "recompute_tokens": None if arm is None else arm[0],
        "recompute_ratio": None if arm is None else arm[1],
        "wall_s": wall,
        "cpu_s": cpu_s,
        "reused_tokens": (reused := sum(o.num_reused_tokens for o in ordered)),
        "recomputed_tokens": (recomputed := sum(o.num_recomputed_tokens for o in ordered)),
        # tokens that ran every layer (selective recompute runs the reused ones through the
        # step too, most of them only up to the check layer)
        "prefill_tokens_computed": after["prefill_tokens_computed"]
        - before["prefill_tokens_computed"]
        - (reused - recomputed if arm is not None and arm[1] > 0 else 0),
        "cached_tokens": sum(o.num_cached_tokens for o in ordered),
        "doc_tokens": sum(n for _, n in work.queries),
        "tokens": [o.outputs[0].token_ids for o in ordered],
        "first_logits": [r.logits[0].float() for r in reqs],
    }


def compare(arm: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    kls, agree, first, equal = [], [], 0, 0
    for lo, lr in zip(arm["first_logits"], ref["first_logits"], strict=True):
        p = torch.log_softmax(lr, -1)
        q = torch.log_softmax(lo, -1)
        kls.append(float((p.exp() * (p - q)).sum()))
    for a, b in zip(arm["tokens"], ref["tokens"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agree.append(n / len(a))
        first += a[0] == b[0]
        equal += a == b
    return {
        "mean_first_token_kl": sum(kls) / len(kls),
        "max_first_token_kl": max(kls),
        "first_token_equal_share": first / len(agree),
        "greedy_agreement": sum(agree) / len(agree),
        "greedy_equal_share": equal / len(agree),
        "first_token_kls": kls,
    }


def header(work: Workload) -> None:
    print(
        f"\nworkload {work.name}: {len(work.register)} documents registered; "
        f"{len(work.queries)} queries; {sum(n for _, n in work.queries)} document tokens"
    )
    print(
        f"{'reuse':<18} {'doc reused':>10} {'recomputed':>10} {'prefill':>8} {'wave s':>7} "
        f"{'cpu s':>7} {'cpu x':>6} {'mean KL':>8} {'max KL':>8} {'first':>6} {'agree':>6} "
        f"{'equal':>6}",
        flush=True,
    )


def row(arm: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Print an arm's line of the table (as soon as it ran); returns its JSON row."""
    q = compare(arm, off)
    if arm["recompute_tokens"] is None:
        name = "off (prefix)"
    else:
        name = f"on {arm['recompute_tokens']}:{arm['recompute_ratio']:g}"
    share = (arm["reused_tokens"] - arm["recomputed_tokens"]) / arm["doc_tokens"]
    speedup = off["cpu_s"] / arm["cpu_s"]
    print(
        f"{name:<18} {share:>10.1%} {arm['recomputed_tokens']:>10} "
        f"{arm['prefill_tokens_computed']:>8} {arm['wall_s']:>7.1f} {arm['cpu_s']:>7.1f} "
        f"{speedup:>5.2f}x {q['mean_first_token_kl']:>8.5f} {q['max_first_token_kl']:>8.5f} "
        f"{q['first_token_equal_share']:>6.2f} {q['greedy_agreement']:>6.2f} "
        f"{q['greedy_equal_share']:>6.2f}",
        flush=True,
    )
    return {
        **{k: v for k, v in arm.items() if k not in ("tokens", "first_logits")},
        "doc_reused_share": share,
        "cpu_speedup_vs_off": speedup,
        "wall_speedup_vs_off": off["wall_s"] / arm["wall_s"],
        **q,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M (GGUF)")
    ap.add_argument("--backend", default="eager", help="graphs.backend for every arm")
    ap.add_argument("--weights", default="auto", help="model.weights for every arm")
    ap.add_argument("--workloads", default="modules,reference", help=f"of {list(WORKLOADS)}")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument(
        "--arms",
        default="16:0,0:0.1,0:0.15,0:0.2,16:0.15",
        help="recompute_tokens:recompute_ratio of each 'on' arm",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = args.model or default_checkpoint()
    with LLM(model=model, overrides=["graphs.backend=eager"]) as llm:
        works = [
            WORKLOADS[w](llm.tokenizer, args.docs, args.queries, args.seed)
            for w in args.workloads.split(",")
        ]
    cpu = lscpu_fields().get("Model name") or cpu_name()
    print(f"position-independent reuse, {model.name}, CPU: {cpu}")
    print(
        f"{NEW_TOKENS} greedy tokens per query; backend {args.backend}; weights {args.weights}; "
        "'cpu x' is the query"
    )
    print("wave's CPU-time speedup over reuse off; 'doc reused' is net of the recomputed tokens;")
    print("'prefill' counts the tokens that ran every layer")
    results = {}
    for work in works:
        header(work)
        off = run_arm(model, args.backend, args.weights, None, work)
        results[work.name] = [row(off, off)]
        for arm in parse_arms(args.arms):
            on = run_arm(model, args.backend, args.weights, arm, work)
            results[work.name].append(row(on, off))
            gc.collect()  # the arm's engine and pools, before the next one's
    write_json(
        {
            "model": str(model),
            "cpu": cpu,
            "docs": args.docs,
            "queries": args.queries,
            "new_tokens": NEW_TOKENS,
            "backend": args.backend,
            "weights": args.weights,
            "workloads": results,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
