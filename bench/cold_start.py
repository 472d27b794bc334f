"""Whole jobs from a cold start: ``hyloop generate`` processes vs a plain transformers script.

Each job is a JSONL of token-id prompts (greedy, EOS ignored, a fixed token count), run as a
separate process end to end (imports, weight loading, any compile or calibration, generation,
writing the output): hyloop with the default config (``graphs.backend=auto``) on an empty
``$HYLOOP_CACHE_DIR`` (cold: no kernel table, no step history, no inductor cache; inductor's
cache lives inside it) and then again on the same directory (warm); transformers loading the
same GGUF and calling ``generate`` on the batch. Also README command 1's job (``hyloop
generate`` with no arguments) cold. Jobs run in turn within one run, so the ratios share the
machine's state; the CPU is named with the table.

    python bench/cold_start.py --json PATH [--jobs 4x64,16x384] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import cpu_name, write_json  # noqa: E402

from hyloop.recipes.offline import default_checkpoint  # noqa: E402

HF_SCRIPT = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
gguf, jobs, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = [json.loads(line) for line in open(jobs)]
model = AutoModelForCausalLM.from_pretrained(
    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
).eval()
ids = torch.tensor([r["prompt_token_ids"] for r in rows])
n = rows[0]["max_tokens"]
with torch.inference_mode():
    got = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0,
    )
with open(out, "w") as fh:
    for row in got[:, ids.shape[1]:].tolist():
        fh.write(json.dumps({"token_ids": row}) + "\\n")
"""


def write_job(path: Path, prompts: int, tokens: int, prompt_len: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(prompts):
            ids = [rng.randrange(100, 49000) for _ in range(prompt_len)]
            row = {"prompt_token_ids": ids, "max_tokens": tokens, "ignore_eos": True}
            fh.write(json.dumps({**row, "temperature": 0.0}) + "\n")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = proc.stderr[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{tail}")
    return wall, proc.stdout + proc.stderr


def read_ids(path: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in path.read_text().splitlines() if line]


def summary_field(log: str, label: str) -> str:
    for line in log.splitlines():
        if line.startswith(label):
            return line[len(label) :].strip()
    return ""


def bench(args: argparse.Namespace) -> dict[str, Any]:
    cpu = cpu_name()
    gguf = default_checkpoint()
    hyloop_bin = str(Path(sys.executable).with_name("hyloop"))
    print(f"cold start on {cpu} ({os.cpu_count()} CPUs)", flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hyloop-cold-") as tmp:
        root = Path(tmp)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
        # README command 1: the built-in default job, cold.
        env = {**base_env, "HYLOOP_CACHE_DIR": str(root / "readme")}
        wall, log = timed([hyloop_bin, "generate", "--no-progress"], env)
        rows.append({"job": "README command 1", "runner": "hyloop cold", "wall_s": wall,
                     "backend": summary_field(log, "auto plan")})  # fmt: skip
        print(f"README command 1 (cold): {wall:.1f} s", flush=True)
        for spec in args.jobs:
            prompts, tokens = (int(x) for x in spec.split("x"))
            job = root / f"job_{spec}.jsonl"
            write_job(job, prompts, tokens, args.prompt_len, seed=prompts * 1000 + tokens)
            hf_out = root / f"hf_{spec}.jsonl"
            hf_wall, _ = timed(
                [sys.executable, "-c", HF_SCRIPT, str(gguf), str(job), str(hf_out)], base_env
            )
            hf_ids = read_ids(hf_out)
            rows.append({"job": spec, "runner": "transformers", "wall_s": hf_wall})
            print(f"{spec}: transformers {hf_wall:.1f} s", flush=True)
            env = {**base_env, "HYLOOP_CACHE_DIR": str(root / f"cache_{spec}")}
            for phase in ("cold", "warm"):
                out = root / f"hy_{spec}_{phase}.jsonl"
                cmd = [hyloop_bin, "generate", "--no-progress", "--input", str(job),
                       "--output", str(out)]  # fmt: skip
                wall, log = timed(cmd, env)
                got = read_ids(out)
                same = sum(a == b for a, b in zip(got, hf_ids, strict=True)) / len(got)
                rows.append({
                    "job": spec, "runner": f"hyloop {phase}", "wall_s": wall,
                    "vs_transformers": hf_wall / wall, "greedy_equal_hf": same,
                    "backend": summary_field(log, "auto plan"),
                })  # fmt: skip
                print(f"{spec}: hyloop {phase} {wall:.1f} s ({hf_wall / wall:.2f}x transformers)",
                      flush=True)  # fmt: skip
    print(f"\nwhole jobs on {cpu}: wall seconds per process (lower is better)")
    print(f"{'job':>16} {'runner':>13} {'wall s':>7} {'vs HF':>6} {'= HF':>5}  auto plan")
    for r in rows:
        ratio = f"{r['vs_transformers']:.2f}x" if "vs_transformers" in r else ""
        same = f"{100 * r['greedy_equal_hf']:.0f}%" if "greedy_equal_hf" in r else ""
        print(f"{r['job']:>16} {r['runner']:>13} {r['wall_s']:>7.1f} {ratio:>6} {same:>5}  "
              f"{r.get('backend', '')[:70]}")  # fmt: skip
    return {"bench": "cold_start", "cpu": cpu, "prompt_len": args.prompt_len, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--jobs", default="4x64,16x384", help="comma list of PROMPTSxTOKENS")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    args = p.parse_args(argv)
    args.jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    write_json(bench(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
