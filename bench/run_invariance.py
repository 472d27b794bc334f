"""Same tokens on every run: one greedy job run in fresh processes under every condition that
must not change a row's numbers, each compared with the warm run.

Conditions: warm (kernels built, batched, the default ``graphs.backend=auto``), cold (a fresh
``HYLOOP_CACHE_DIR``: the kernels are built when the model loads), no compiler (a fresh cache
directory and no C++ compiler on ``PATH``: torch ops, eager steps), kernels off
(``HYLOOP_CPU_OPS=0``), beside two busy processes (the whole job, capture plan included, with
two spinning processes on the machine), each prompt alone, eager, compile. On the SmolLM2 GGUF
as shipped (``model.weights=auto``) and on its weights dequantized to bfloat16.

    python bench/run_invariance.py [--prompts 12] [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import cpu_name  # type: ignore[import-not-found]

from hyloop.recipes.offline import default_checkpoint

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "The quick brown fox",
    "In 1969, the first person to walk on the moon was",
    "Translate to French: good morning",
    "SELECT name FROM users WHERE",
    "The main ingredients of bread are",
    "Once upon a time, in a small village,",
    "Explain photosynthesis in one sentence.",
    "import numpy as np\nx = np.arange(10)\n",
    "The three laws of motion are",
    "My favourite colour is",
    "Water boils at",
    "A list of fruits: apple,",
]

CHILD = r"""
import json, sys
from hyloop import LLM, SamplingParams
args = json.loads(sys.argv[1])
with LLM(model=args["model"], overrides=args["overrides"]) as llm:
    params = SamplingParams(temperature=0, max_tokens=args["tokens"], ignore_eos=True)
    if args["alone"]:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in args["prompts"]]
    else:
        outs = llm.generate(args["prompts"], params, use_tqdm=False)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "numerics": llm.stats()["numerics"],
                      "backend": llm.stats()["backend_config"]}))
"""


def _spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


def run(
    model: str,
    prompts: list[str],
    tokens: int,
    overrides: list[str],
    env: dict[str, str],
    alone: bool = False,
) -> dict:
    args = json.dumps(
        {
            "model": model,
            "prompts": prompts,
            "tokens": tokens,
            "overrides": overrides,
            "alone": alone,
        }
    )
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({overrides}, alone={alone}):\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def no_compiler_path(root: Path) -> str:
    """A PATH with every directory of this one, less any C++ compiler (symlinked copies)."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    hidden = {"g++", "c++", "gcc", "cc", "clang", "clang++"}
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            target = bin_dir / name
            if name in hidden or target.exists() or name.startswith(("g++-", "gcc-", "c++-")):
                continue
            if name.startswith("x86_64-linux-gnu-g"):
                continue
            target.symlink_to(os.path.join(d, name))
    return str(bin_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default="bench/run_invariance.json")
    ap.add_argument("--weights", nargs="+", default=["auto", "bf16"])
    a = ap.parse_args()
    model = str(default_checkpoint())
    prompts = PROMPTS[: a.prompts]
    base = dict(os.environ)
    base.pop("HYLOOP_CPU_OPS", None)
    work = Path(tempfile.mkdtemp(prefix="hyloop-invariance-"))
    warm_dir = work / "warm"
    results: dict = {"cpu": cpu_name(), "python": platform.python_version(), "rows": []}
    for weights in a.weights:
        common = (
            ["model.weights=auto"]
            if weights == "auto"
            else ["model.weights=dequantize", "dtype=bfloat16"]
        )
        env = {**base, "HYLOOP_CACHE_DIR": str(warm_dir)}
        run(model, prompts[:1], 2, common, env)  # builds the kernels once: later runs are warm
        warm = run(model, prompts, a.tokens, common, env)
        cases: list[tuple[str, list[str], dict[str, str], bool]] = [
            (
                "cold (fresh cache dir)",
                common,
                {**base, "HYLOOP_CACHE_DIR": str(work / f"cold-{weights}")},
                False,
            ),
            (
                "no C++ compiler",
                common,
                {
                    **base,
                    "HYLOOP_CACHE_DIR": str(work / f"nocc-{weights}"),
                    "PATH": no_compiler_path(work / f"nocc-path-{weights}"),
                },
                False,
            ),
            ("HYLOOP_CPU_OPS=0", common, {**env, "HYLOOP_CPU_OPS": "0"}, False),
            ("each prompt alone", common, env, True),
            ("eager", [*common, "graphs.backend=eager"], env, False),
            ("compile", [*common, "graphs.backend=compile"], env, False),
        ]
        env.pop("CXX", None)
        rows = [("warm (reference)", warm)]
        for name, overrides, case_env, alone in cases:
            rows.append((name, run(model, prompts, a.tokens, overrides, case_env, alone)))
        busy_env = {**base, "HYLOOP_CACHE_DIR": str(work / f"busy-{weights}")}
        shutil.copytree(warm_dir / "cpu_ops", work / f"busy-{weights}" / "cpu_ops")
        spinners = [mp.Process(target=_spin, args=(600,)) for _ in range(2)]
        for s in spinners:
            s.start()
        try:
            rows.append(
                ("beside two busy processes", run(model, prompts, a.tokens, common, busy_env))
            )
        finally:
            for s in spinners:
                s.terminate()
        for name, out in rows:
            same = sum(t == w for t, w in zip(out["tokens"], warm["tokens"], strict=True))
            first = [
                next((i for i, (x, y) in enumerate(zip(t, w, strict=True)) if x != y), None)
                for t, w in zip(out["tokens"], warm["tokens"], strict=True)
            ]
            results["rows"].append(
                {
                    "weights": weights,
                    "case": name,
                    "identical": same,
                    "of": len(prompts),
                    "first_difference": [f for f in first if f is not None],
                    "numerics": out["numerics"],
                    "backend": out["backend"],
                    "seconds": out["seconds"],
                }
            )
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nCPU: {results['cpu']}; SmolLM2-135M-Instruct, {len(prompts)} prompts x {a.tokens} "
        "greedy tokens, each case a fresh process, compared with the warm run"
    )
    print("| weights | case | identical | backend | s |")
    print("|---|---|---:|---|---:|")
    for r in results["rows"]:
        label = "GGUF as shipped (auto)" if r["weights"] == "auto" else "bf16 dequantized"
        print(
            f"| {label} | {r['case']} | {r['identical']} / {r['of']} | {r['backend']} "
            f"| {r['seconds']} |"
        )
    for w in a.weights:
        nums = {r["numerics"] for r in results["rows"] if r["weights"] == w}
        print(f"numerics ({w}): " + " || ".join(sorted(nums)))
    Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
