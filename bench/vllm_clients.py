"""Real vLLM clients on hyloop: lm-eval-harness and outlines, against transformers.

SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized to float32). Three local lm-eval tasks
(``tests/lm_eval_tasks.py``: ``--items`` multiple-choice and generate_until items, five rolling
texts), each run in its own process:

- ``vllm route``: lm-eval's unmodified ``vllm`` backend by ``python -m hyloop.compat.vllm
  lm_eval``, on the GGUF's weights exported as an HF directory; against lm-eval's HF backend on
  that directory;
- ``hyloop model``: ``python -m hyloop.compat.lm_eval --model hyloop`` on the GGUF file itself
  (``model.weights=dequantize``); against lm-eval's HF backend with ``gguf_file=``.

Per task: items whose choice (argmax log-likelihood) / generation equals the reference, and the
largest log-likelihood difference. Then outlines' ``from_vllm_offline`` (after ``import
hyloop.compat.vllm``): ``--seeds`` seeded requests each for a pydantic JSON schema, a regex and a
``Literal`` choice, every output validated; JSON outputs counted for unlisted keys, and their
longest length in tokens (``max_tokens`` 100).

    python bench/vllm_clients.py [--items 20] [--seeds 8] [--json PATH] [--model GGUF]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tests"))

import lm_eval_tasks as tasks  # noqa: E402
from common import cpu_name, write_json  # noqa: E402

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def lm_eval_run(route: list[str], model: str, args: str, task_dir: Path, out: Path) -> Any:
    """One ``lm_eval run`` in a fresh process: per-item responses and its wall time."""
    cmd = [sys.executable, "-m", *route, "run", "--model", model, "--model_args", args]
    cmd += ["--tasks", *tasks.TASKS, "--include_path", str(task_dir)]
    cmd += ["--batch_size", "1", "--device", "cpu"] if model == "hf" else ["--batch_size", "auto"]
    cmd += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return tasks.responses(tasks.read_logged_samples(out)), time.perf_counter() - t0


def compare(got: dict[str, list[Any]], ref: dict[str, list[Any]]) -> dict[str, Any]:
    mc = list(zip(got["hy_mc"], ref["hy_mc"], strict=True))
    rolling = list(zip(got["hy_rolling"], ref["hy_rolling"], strict=True))
    return {
        "mc_items": len(mc),
        "mc_choices_equal": sum(a.index(max(a)) == b.index(max(b)) for a, b in mc),
        "mc_max_abs_diff": max(abs(x - y) for a, b in mc for x, y in zip(a, b, strict=True)),
        "gen_items": len(ref["hy_gen"]),
        "gen_equal": sum(a == b for a, b in zip(got["hy_gen"], ref["hy_gen"], strict=True)),
        "rolling_items": len(rolling),
        "rolling_max_abs_diff": max(abs(a - b) for a, b in rolling),
    }


def run_outlines(gguf: Path, seeds: int) -> dict[str, Any]:
    import hyloop.compat.vllm  # noqa: F401  the documented route, before vllm is imported

    # isort: split
    import outlines
    from outlines.types import Regex
    from pydantic import BaseModel, ValidationError
    from vllm import LLM, SamplingParams

    class Person(BaseModel):
        name: str
        age: int
        city: str

    def person(text: str) -> tuple[bool, bool]:
        try:
            data = json.loads(text)
            Person.model_validate(data)
        except (ValueError, ValidationError):
            return False, False
        return True, set(data) - set(Person.model_fields) != set()

    llm = LLM(str(gguf), enforce_eager=True, max_model_len=2048)
    model = outlines.from_vllm_offline(llm)
    tok = llm.get_tokenizer()
    cases: dict[str, Any] = {
        "json (pydantic)": ("Describe a person as JSON.", Person),
        "regex [0-9]{1,3}": ("2+2=", Regex(r"[0-9]{1,3}")),
        "choice yes/no": ("Is the sky blue?", Literal["yes", "no"]),
    }
    out: dict[str, Any] = {}
    for name, (prompt, kind) in cases.items():
        valid = unlisted = longest = 0
        t0 = time.perf_counter()
        for seed in range(seeds):
            params = SamplingParams(temperature=0.8, seed=seed, max_tokens=100)
            text = model(prompt, kind, sampling_params=params)
            longest = max(longest, len(tok.encode(text, add_special_tokens=False)))
            if kind is Person:
                ok, extra = person(text)
                valid, unlisted = valid + ok, unlisted + extra
            elif name.startswith("regex"):
                valid += re.fullmatch(r"[0-9]{1,3}", text) is not None
            else:
                valid += text in ("yes", "no")
        out[name] = {
            "requests": seeds,
            "valid": valid,
            "unlisted_keys": unlisted,
            "max_tokens_used": longest,
            "seconds": time.perf_counter() - t0,
        }
    llm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20, help="multiple-choice and gen items")
    parser.add_argument("--seeds", type=int, default=8, help="outlines requests per case")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default SmolLM2)")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    from hyloop.recipes.offline import default_checkpoint

    gguf = a.model or default_checkpoint()
    n = min(a.items, len(tasks.MC), len(tasks.GEN))
    tmp = Path(tempfile.mkdtemp(prefix="vllm_clients_"))
    task_dir = tasks.write_tasks(tmp / "tasks", n, n, len(tasks.ROLLING))
    hf_dir = tasks.export_hf_dir(gguf, tmp / "hf")
    hf_gguf = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32"
    runs = {
        "hf dir": (["lm_eval"], "hf", f"pretrained={hf_dir},dtype=float32"),
        "vllm route": (
            ["hyloop.compat.vllm", "lm_eval"],
            "vllm",
            f"pretrained={hf_dir},dtype=float32,enforce_eager=True",
        ),
        "hf gguf_file": (["lm_eval"], "hf", hf_gguf),
        "hyloop model": (
            ["hyloop.compat.lm_eval"],
            "hyloop",
            f"pretrained={gguf},model.weights=dequantize,enforce_eager=True",
        ),
    }
    got, seconds = {}, {}
    for name, (route, model, args) in runs.items():
        got[name], seconds[name] = lm_eval_run(route, model, args, task_dir, tmp / name)
        print(f"{name}: {seconds[name]:.1f} s", file=sys.stderr)
    lm_eval = {
        "vllm route vs hf dir": compare(got["vllm route"], got["hf dir"]),
        "hyloop model (gguf) vs hf gguf_file": compare(got["hyloop model"], got["hf gguf_file"]),
    }
    outlines = run_outlines(gguf, a.seeds)
    print(f"\nlm-eval-harness 0.4.13, SmolLM2-135M-Instruct float32, {cpu_name()}\n")
    print("| route | choices equal | max abs d loglik | generations equal | rolling max abs d |")
    print("|---|---:|---:|---:|---:|")
    for name, c in lm_eval.items():
        print(
            f"| {name} | {c['mc_choices_equal']}/{c['mc_items']} | {c['mc_max_abs_diff']:.1e} "
            f"| {c['gen_equal']}/{c['gen_items']} | {c['rolling_max_abs_diff']:.1e} |"
        )
    print("\noutlines 1.3.3, from_vllm_offline, seeded (temperature 0.8, max_tokens 100)\n")
    print("| case | valid | unlisted keys | longest output (tokens) |")
    print("|---|---:|---:|---:|")
    for name, c in outlines.items():
        print(
            f"| {name} | {c['valid']}/{c['requests']} | {c['unlisted_keys']} "
            f"| {c['max_tokens_used']} |"
        )
    write_json(
        {
            "bench": "vllm_clients",
            "model": str(gguf),
            "lm_eval": lm_eval,
            "lm_eval_seconds": seconds,
            "outlines": outlines,
            "responses": got,
        },
        a.json,
    )


if __name__ == "__main__":
    main()
