"""Position-independent reuse on SmolLM2: RAG-shaped traffic, reuse off vs on.

Documents of 500-1,000 tokens (English reference text: the docstrings of Python standard-library
modules and their members, tokenized by SmolLM2) are registered by a first wave of requests
(system prompt A + document + question). The query wave then asks questions over two documents
each, behind another system prompt B, 16 greedy tokens. Both arms keep the exact-prefix cache on;
reuse off serves only system prompt B from it. Per arm: document tokens reused, prefill tokens
computed in the query wave, its wall time, and against reuse off the mean first-token KL and the
16-token greedy agreement (mean agreeing prefix, and the share of queries fully equal), for
``recompute_tokens`` 0 / 8 / 16 / 32. Prints the table with the CPU's name and writes JSON.

    python bench/position_independent.py --json /tmp/pi.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import cpu_name, write_json  # noqa: E402

from hyloop import LLM, SamplingParams  # noqa: E402
from hyloop.recipes.offline import default_checkpoint  # noqa: E402

MODULES = [
    "argparse", "json", "csv", "statistics", "re", "heapq", "itertools", "socket",
    "ssl", "urllib.request", "subprocess", "difflib", "http.client", "tempfile",
]  # fmt: skip
SYSTEM_A = "You are a librarian. Read the reference document and file it under a topic.\n\n"
SYSTEM_B = (
    "You are a careful assistant. Answer the question using only the documents below; "
    "say which document you used.\n\n"
)
NEW_TOKENS = 16


def module_text(name: str) -> str:
    """A module's docstring and its public members' docstrings, as one document."""
    mod = importlib.import_module(name)
    parts = [f"Document: the {name} module.\n{inspect.getdoc(mod) or ''}"]
    for attr in sorted(dir(mod)):
        obj = getattr(mod, attr)
        if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            parts.append(f"{attr}: {doc}")
    return "\n\n".join(parts)


def build_traffic(
    llm: LLM, num_docs: int, num_queries: int, seed: int
) -> tuple[list[list[int]], list[tuple[list[int], int]]]:
    """Registration prompts, and query prompts with the number of document tokens in each."""
    rng = random.Random(seed)
    tok = llm.tokenizer
    docs: list[list[int]] = []
    for name in MODULES:
        ids = tok.encode(module_text(name))
        if len(ids) >= 500:
            docs.append(ids[: rng.randint(500, 1000)])
        if len(docs) == num_docs:
            break
    if len(docs) < num_docs:
        raise SystemExit(f"only {len(docs)} documents of >= 500 tokens; lower --docs")
    sys_a, sys_b = tok.encode(SYSTEM_A), tok.encode(SYSTEM_B)
    register = [sys_a + d + tok.encode("\n\nTopic:") for d in docs]
    queries: list[tuple[list[int], int]] = []
    # Every query leads with a different document, so the exact prefix serves system prompt B
    # only and never a document: what the documents save is position-independent reuse alone.
    if num_queries > num_docs:
        raise SystemExit(f"--queries {num_queries} > --docs {num_docs}: a lead document repeats")
    leads = rng.sample(range(num_docs), num_queries)
    for q, i in enumerate(leads):
        j = rng.choice([d for d in range(num_docs) if d != i])
        question = tok.encode(f"\n\nQuestion {q}: what do these two modules have in common?\n")
        prompt = sys_b + docs[i] + tok.encode("\n\n") + docs[j] + question
        queries.append((prompt, len(docs[i]) + len(docs[j])))
    return register, queries


def run_arm(
    model: Path,
    backend: str,
    recompute: int | None,
    register: list[list[int]],
    queries: list[tuple[list[int], int]],
) -> dict[str, Any]:
    overrides = [f"graphs.backend={backend}", "kv_pool.num_pages=40000"]
    if recompute is not None:
        overrides += [
            "cache.position_independent.enable=true",
            f"cache.position_independent.recompute_tokens={recompute}",
        ]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=model, overrides=overrides) as llm:
        llm.generate(
            [register[0][:40]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
        )  # warm up
        llm.generate(register, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        engine = llm.engine
        engine.capture_logits = True
        before = llm.stats()
        reqs, outs = [], {}
        t0, c0 = time.perf_counter(), time.process_time()
        for i, (prompt, _) in enumerate(queries):
            engine.add_request(f"q{i}", prompt, greedy)
            reqs.append(engine.request(f"q{i}"))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        engine.check_invariants()
        after = llm.stats()
    ordered = [outs[f"q{i}"] for i in range(len(queries))]
    return {
        "recompute_tokens": recompute,
        "wall_s": wall,
        "cpu_s": cpu_s,  # this process's CPU time: less sensitive to other load on the machine
        "prefill_tokens_computed": after["prefill_tokens_computed"]
        - before["prefill_tokens_computed"],
        "reused_tokens": sum(o.num_reused_tokens for o in ordered),
        "cached_tokens": sum(o.num_cached_tokens for o in ordered),
        "doc_tokens": sum(n for _, n in queries),
        "tokens": [o.outputs[0].token_ids for o in ordered],
        "first_logits": [r.logits[0].float() for r in reqs],
    }


def compare(arm: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    kls, agree, equal = [], [], 0
    for lo, lr in zip(arm["first_logits"], ref["first_logits"], strict=True):
        p = torch.log_softmax(lr, -1)
        q = torch.log_softmax(lo, -1)
        kls.append(float((p.exp() * (p - q)).sum()))
    for a, b in zip(arm["tokens"], ref["tokens"], strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agree.append(n / len(a))
        equal += a == b
    return {
        "mean_first_token_kl": sum(kls) / len(kls),
        "max_first_token_kl": max(kls),
        "greedy_agreement": sum(agree) / len(agree),
        "greedy_equal_share": equal / len(agree),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M (GGUF)")
    ap.add_argument("--backend", default="eager", help="graphs.backend for every arm")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--recompute", default="0,8,16,32", help="recompute_tokens values")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = args.model or default_checkpoint()
    with LLM(model=model, overrides=["graphs.backend=eager"]) as llm:
        register, queries = build_traffic(llm, args.docs, args.queries, args.seed)
    off = run_arm(model, args.backend, None, register, queries)
    arms = [
        run_arm(model, args.backend, int(r), register, queries) for r in args.recompute.split(",")
    ]
    cpu = cpu_name()
    print(f"position-independent reuse, {model.name}, CPU: {cpu}")
    print(
        f"{args.docs} documents registered; {args.queries} queries of 2 documents behind another "
        f"system prompt; {NEW_TOKENS} greedy tokens; backend {args.backend}"
    )
    head = (
        f"{'reuse':<14} {'doc reused':>10} {'prefill computed':>16} {'wave s':>8} {'speedup':>8} "
        f"{'cpu s':>7} "
        f"{'mean KL':>9} {'max KL':>9} {'agree':>6} {'equal':>6}"
    )
    print(head)
    rows = []
    for arm in [off, *arms]:
        is_off = arm["recompute_tokens"] is None
        q = compare(arm, off)
        name = "off (prefix)" if is_off else f"on, recomp {arm['recompute_tokens']}"
        share = arm["reused_tokens"] / arm["doc_tokens"]
        speedup = off["wall_s"] / arm["wall_s"]
        print(
            f"{name:<14} {share:>10.1%} {arm['prefill_tokens_computed']:>16} "
            f"{arm['wall_s']:>8.2f} {speedup:>7.2f}x {arm['cpu_s']:>7.1f} "
            f"{q['mean_first_token_kl']:>9.5f} "
            f"{q['max_first_token_kl']:>9.5f} {q['greedy_agreement']:>6.2f} "
            f"{q['greedy_equal_share']:>6.2f}"
        )
        rows.append(
            {
                **{k: v for k, v in arm.items() if k not in ("tokens", "first_logits")},
                "doc_reused_share": share,
                "speedup_vs_off": speedup,
                **q,
            }
        )
    write_json(
        {
            "model": str(model),
            "cpu": cpu,
            "docs": args.docs,
            "queries": args.queries,
            "new_tokens": NEW_TOKENS,
            "backend": args.backend,
            "arms": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
