"""One bench script run on two trees of hyloop in turn, in one session: each round runs it once
per tree (in that order, then the other way round the next round), every run its own process
importing its tree's ``hyloop`` (``PYTHONPATH``), with its own cache directory (each tree builds
its own CPU kernels first, outside the timing). The table keeps, per figure, the best of the
rounds for each tree and their ratio.

    git worktree add /tmp/parent HEAD~3
    python bench/ab_commits.py --base /tmp/parent --rounds 3 -- bench/peers.py --quick --skip-hf

Figures are the numbers the script writes to its ``--json``: those under keys named ``b1``,
``b16``, ``*_tok_s`` or ``ppl``, named by the row's ``engine`` / ``model`` / ``variant`` /
``workload`` (and its ``batch``) and the keys on the way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import cpu_name  # type: ignore[import-not-found]

FIGURE = re.compile(r"^(b1|b16|.*_tok_s|ppl)$")
NAMES = ("engine", "model", "variant", "workload")  # a row's name, with its batch (``b16``)


def figures(node: Any, path: str = "") -> dict[str, float]:
    """Every figure in a bench's JSON, by a readable path."""
    out: dict[str, float] = {}
    if isinstance(node, dict):
        label = " ".join(str(node[k]) for k in NAMES if isinstance(node.get(k), str))
        if isinstance(node.get("batch"), int) and label:
            label += f" b{node['batch']}"
        here = f"{path} {label}".strip() if label else path
        for key, value in node.items():
            if key in ("waves", "args", "machine", "cpu"):
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                if FIGURE.match(key):
                    out[f"{here} {key}".strip()] = float(value)
            else:
                out.update(figures(value, f"{here} {key}".strip() if key != "rows" else here))
    elif isinstance(node, list):
        for item in node:
            out.update(figures(item, path))
    return out


def run(tree: Path, cache: Path, script: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HYLOOP_CACHE_DIR": str(cache)}
    cmd = [sys.executable, str(tree / script[0]), *script[1:], "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return figures(json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other tree (a git worktree)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    trees = {"base": Path(a.base).resolve(), "this": Path(__file__).resolve().parent.parent}
    work = Path(tempfile.mkdtemp(prefix="hyloop-ab-"))
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    order = list(trees)
    for r in range(a.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            got = run(trees[name], work / name, script, work / f"{name}-{r}.json")
            for key, value in got.items():
                keep = min if key.endswith("ppl") else max
                best[name][key] = keep(best[name].get(key, value), value)
            print(f"round {r + 1}: {name} done", file=sys.stderr)
    rows = []
    for key in best["this"]:
        if key in best["base"]:
            base, this = best["base"][key], best["this"][key]
            rows.append({"figure": key, "base": base, "this": this, "ratio": this / base})
    print(f"\n{' '.join(script)}: best of {a.rounds} rounds; CPU: {cpu_name()}")
    print(f"| figure | base ({trees['base'].name}) | this | this / base |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['figure']} | {row['base']:.2f} | {row['this']:.2f} | {row['ratio']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"script": script, "cpu": cpu_name(), "rows": rows}))


if __name__ == "__main__":
    main()
