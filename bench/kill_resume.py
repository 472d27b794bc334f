"""Kill batch jobs at random points and resume them: does every resumed output equal an
uninterrupted run?

For each job (``run-batch``, ``generate``, and with ``--ray`` ``generate --ray 2``) on a tiny
random Llama (eager, CPU): a clean run of ``--rows`` rows, then ``--kills`` starts with
``--resume``, each ended by SIGKILL, SIGINT or SIGTERM (in turn) at a random point (one in five
while the model loads, the rest once the output holds a random number of lines; for Ray, whose
driver writes in order what the replicas finish out of order, at a random time of a clean run),
then one start that runs to the end. Kills stop once the output is whole. Checked: the
resumed output equals the clean one (but for ids, times and cache hits), each row once, no file
beside it; a handled signal exits 130 / 143 with a summary line and no traceback. The harness is
``tests/kill_resume.py`` (the suite's ``test_kill_resume`` runs a smaller version).

    .venv/bin/python bench/kill_resume.py --rows 200 --kills 10 --json kill_resume.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_name, test_helpers, write_json  # noqa: E402

conftest = test_helpers()  # also puts tests/ on the path, for the harness
from kill_resume import (  # noqa: E402
    SIGNALS,
    command,
    compare,
    job_env,
    kill_and_resume,
    progress_kills,
    read_output,
    timed,
    write_rows,
)


def one_job(
    root: Path, job: str, model: Path, rows: int, kills: int, seed: int, running: int
) -> dict[str, Any]:
    ray = 2 if job == "ray" else 0
    kind = "generate" if job == "ray" else job
    (root / "in").mkdir(parents=True)
    src = write_rows(root / "in" / "rows.jsonl", kind, rows, 32)
    env = job_env(root / "cache")
    clean_dst = root / "clean" / "out.jsonl"
    clean_dst.parent.mkdir()
    seconds, first = timed(command(kind, model, src, clean_dst, ray, running), env, clean_dst)
    clean = read_output(clean_dst)
    rng = random.Random(f"{seed}-{job}")
    if ray:  # the driver writes in order what two replicas finish out of order: kill by time
        points = [(SIGNALS[k % 3], rng.uniform(0.6 * first, seconds), 0) for k in range(kills)]
    else:
        points = progress_kills(rng, kills, rows, first)
    dst = root / "resumed" / "out.jsonl"
    dst.parent.mkdir()
    t0 = time.perf_counter()
    cmd = command(kind, model, src, dst, ray, running)
    attempts = kill_and_resume(cmd, dst, env, points, rows)
    problems = [p for a in attempts for p in a.problems] + compare(clean, read_output(dst), dst)
    return {
        "job": "generate --ray 2" if ray else job,
        "rows": rows,
        "clean_s": round(seconds, 2),
        "first_line_s": round(first, 2),
        "resume_total_s": round(time.perf_counter() - t0, 2),
        "attempts": [
            {
                "signal": a.signal,
                "delay_s": round(a.delay_s, 2),
                "exit": a.returncode,
                "lines_after": a.lines_after,
            }
            for a in attempts
        ],
        "equal": not problems,
        "problems": problems,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--running", type=int, default=4, help="scheduler.max_running_requests")
    ap.add_argument("--ray", action="store_true", help="also generate --ray 2 (needs ray)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    jobs = ["run-batch", "generate", *(["ray"] if args.ray else [])]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = conftest.build_hf_checkpoint(Path(tmp) / "llama", conftest.TINY_DENSE["llama"])
        for job in jobs:
            res = one_job(
                Path(tmp) / job, job, model, args.rows, args.kills, args.seed, args.running
            )
            results.append(res)
    print(f"kill and resume, {args.rows} rows, {args.kills} kills a job ({cpu_name()}, eager)")
    head = f"{'job':<18} {'clean s':>7} {'kills K/I/T':>11} {'mid-job':>7} {'130/143':>7}"
    print(f"{head} {'lines after each start':<44} {'equal':>5}")
    for r in results:
        sigs = [a["signal"] for a in r["attempts"] if a["signal"]]
        counts = "/".join(str(sigs.count(s)) for s in ("SIGKILL", "SIGINT", "SIGTERM"))
        handled = sum(a["exit"] in (130, 143) for a in r["attempts"])
        lines = ",".join(str(a["lines_after"]) for a in r["attempts"])
        equal = "yes" if r["equal"] else "NO"
        before = [0] + [a["lines_after"] for a in r["attempts"]]
        mid = sum(
            a["signal"] is not None and before[k] < r["rows"] for k, a in enumerate(r["attempts"])
        )
        cells = f"{counts:>11} {mid:>7} {handled:>7} {lines:<44} {equal:>5}"
        print(f"{r['job']:<18} {r['clean_s']:>7.1f} {cells}")
        for p in r["problems"]:
            print(f"  problem: {p[:300]}")
    write_json({"rows": args.rows, "kills": args.kills, "results": results}, args.json)
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
