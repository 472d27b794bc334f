"""Kill a batch job at random points and resume it: the harness of ``test_kill_resume`` and
``bench/kill_resume.py``.

A job (``run-batch``, ``generate``, or ``generate --ray N``) runs as a child process over a JSONL
of greedy, seeded and unseeded sampled rows. ``kill_and_resume`` starts it with ``--resume``,
sends SIGKILL, SIGINT or SIGTERM after a random delay, and starts it again, until a run
finishes; the output must then equal an uninterrupted run's (``normal``: only ``id``,
``request_id``, ``created`` and ``cached_tokens`` may differ), hold each row once, and be the
only file beside it. A signal that may be handled must end the process with 130 / 143 (or 0, had
it finished), one summary line and no traceback.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGKILL, signal.SIGINT, signal.SIGTERM)
Kill = tuple[int, float, int]  # (signal, delay s, output lines to wait for first; 0: none)
OVERRIDES = ["graphs.backend=eager", "model.max_context=256"]


def write_rows(path: Path, job: str, rows: int, max_tokens: int, seed: int = 0) -> Path:
    """``rows`` lines for ``job``: a third greedy, a third seeded, a third unseeded sampled (their
    seeds come from the config's seed and the row's id), prompts of token ids."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 12))]
        params: dict[str, Any] = {"max_tokens": rng.randrange(max_tokens // 2, max_tokens + 1)}
        if i % 3 == 0:
            params["temperature"] = 0.0
        else:
            params["temperature"] = 0.9
            if i % 3 == 1:
                params["seed"] = rng.randrange(2**40)
        if job == "run-batch":
            body = {"prompt": prompt, **params}
            row = {"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions"}
            lines.append({**row, "body": body})
        else:
            lines.append({"id": f"row-{i}", "prompt_token_ids": prompt, **params})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def command(
    job: str, model: Path, src: Path, dst: Path, ray: int = 0, running: int = 8
) -> list[str]:
    """The CLI command of ``job`` (``--resume`` always: a missing output runs the whole job);
    ``running``: requests a step batches (fewer: a longer job, more room to kill it in)."""
    base = [sys.executable, "-m", "hyloop.cli"]
    if job == "run-batch":
        args = ["run-batch", "-i", str(src), "-o", str(dst)]
    else:
        args = ["generate", "--input", str(src), "--output", str(dst)]
        if ray:
            args += ["--ray", str(ray), "ray.batch_size=16"]
    running_key = f"scheduler.max_running_requests={running}"
    return [
        *base,
        *args,
        "--model",
        str(model),
        "--no-progress",
        "--resume",
        *OVERRIDES,
        running_key,
    ]


def normal(line: dict[str, Any]) -> dict[str, Any]:
    """A line without what may differ between runs (ids, times, cache hits)."""
    line = json.loads(json.dumps(line))
    line.pop("id", None) if "custom_id" in line else None
    line.pop("num_cached_tokens", None)
    response = line.get("response")
    if isinstance(response, dict):
        response.pop("request_id", None)
        body = response.get("body")
        if isinstance(body, dict):
            body.pop("id", None)
            body.pop("created", None)
            body.get("usage", {}).get("prompt_tokens_details", {}).pop("cached_tokens", None)
    return line


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@dataclass
class Attempt:
    """One start of the job: the signal sent (None: ran to its end), after how long, how it
    exited, the lines on disk after it, and what went wrong with how it ended."""

    signal: str | None
    delay_s: float
    returncode: int
    lines_after: int
    problems: list[str] = field(default_factory=list)


def run(
    cmd: list[str],
    env: dict[str, str],
    sig: int | None,
    delay: float,
    at: tuple[Path, int] | None = None,
) -> tuple[int, str]:
    """Run ``cmd``; send ``sig`` ``delay`` s after its start or, with ``at = (output, n)``, once
    the output holds ``n`` lines and one this run wrote (then ``delay`` s later): a resumed run
    whose output already held ``n`` lines is signalled once it runs, not while the interpreter
    starts (a SIGINT inside Python's own start-up ends it with that traceback, whatever the
    program). Returns its exit code and stderr."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if sig is not None and at is not None:
        want = max(at[1], _lines(at[0]) + 1)
        while proc.poll() is None and _lines(at[0]) < want:
            time.sleep(0.005)
    if sig is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err.decode(errors="replace")


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def check_exit(sig: int | None, code: int, err: str) -> list[str]:
    """What is wrong with how a run ended (empty: nothing)."""
    problems = []
    if "Traceback" in err:
        problems.append("traceback on stderr: " + err[err.index("Traceback") :][:400])
    if sig == signal.SIGKILL:
        ok = {-signal.SIGKILL, 0}
    elif sig is not None:
        ok = {128 + sig, 0, -sig}  # -sig: it came before the handlers were in place
    else:
        ok = {0}
    if code not in ok:
        problems.append(f"exit code {code}, expected one of {sorted(ok)}: {err[-400:]}")
    if sig in (signal.SIGINT, signal.SIGTERM) and code == 128 + sig:
        last = [x for x in err.splitlines() if x.strip()][-1:]
        if not last or "interrupted by" not in last[0]:
            problems.append(f"no summary line after {signal.Signals(sig).name}: {err[-300:]}")
    return problems


def kill_and_resume(
    cmd: list[str], dst: Path, env: dict[str, str], kills: list[Kill], rows: int | None = None
) -> list[Attempt]:
    """Start ``cmd`` once per kill (``Kill``), then once more to its end; with ``rows``, the
    kills stop once the output holds them all (a start that has nothing to do is not one)."""
    attempts = []
    for sig, delay, lines in [*kills, (None, 0.0, 0)]:
        if sig is not None and rows is not None and _lines(dst) >= rows:
            continue
        code, err = run(cmd, env, sig, delay, (dst, lines) if lines else None)
        name = signal.Signals(sig).name if sig is not None else None
        attempts.append(Attempt(name, delay, code, _lines(dst), check_exit(sig, code, err)))
    return attempts


def progress_kills(rng: random.Random, n: int, rows: int, first: float) -> list[Kill]:
    """``n`` kills, the signals in turn, at random points of the job whatever its speed: one in
    five at a random time before a clean run's first line (the model still loading), the rest
    once the output holds a random number of lines (ascending, so each start gets further),
    0-0.2 s later."""
    early = [k for k in range(n) if k % 5 == 2]
    targets = sorted(rng.sample(range(1, rows), n - len(early)))
    out: list[Kill] = []
    for k in range(n):
        if k in early:
            out.append((SIGNALS[k % 3], rng.uniform(0.3, max(first, 0.6)), 0))
        else:
            out.append((SIGNALS[k % 3], rng.uniform(0.0, 0.2), targets.pop(0)))
    return out


def compare(clean: list[dict[str, Any]], resumed: list[dict[str, Any]], dst: Path) -> list[str]:
    """Differences between the resumed output and the clean one, and stray files."""
    problems = []
    if len(resumed) != len(clean):
        problems.append(f"{len(resumed)} lines, expected {len(clean)}")
    for k, (a, b) in enumerate(zip(clean, resumed, strict=False)):
        if normal(a) != normal(b):
            problems.append(f"line {k + 1} differs: {normal(a)} != {normal(b)}")
            break
    extra = sorted(p.name for p in dst.parent.iterdir() if p != dst)
    if extra:
        problems.append(f"files beside the output: {extra}")
    return problems


def job_env(cache: Path) -> dict[str, str]:
    """One torch thread per process, and ``cache`` as ``$HYLOOP_CACHE_DIR`` (the jobs' resume
    records go there), its other folders linked to the machine's (built kernels, timings)."""
    from hyloop.models.cpu.kernel_choice import cache_dir

    cache.mkdir(parents=True, exist_ok=True)
    machine = cache_dir()
    for entry in machine.iterdir() if machine.is_dir() else []:
        if entry.name != "jobs" and not (cache / entry.name).exists():
            (cache / entry.name).symlink_to(entry)
    env = dict(os.environ)
    env.update(HYLOOP_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    return env


def timed(cmd: list[str], env: dict[str, str], dst: Path) -> tuple[float, float]:
    """Run ``cmd`` to its end: ``(seconds, seconds until its first output line)``, the window in
    which a kill finds rows running."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while proc.poll() is None:
        if first is None and dst.exists() and dst.stat().st_size:
            first = time.perf_counter() - t0
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    return seconds, first if first is not None else seconds


def kill_points(rng: random.Random, n: int, first: float, seconds: float) -> list[Kill]:
    """``n`` kills, the signals in turn, each at a random point from a little before a clean
    run's first line: within ``2 / n`` of its generating time after it, so that each start gets
    about ``1 / n`` of the job done and the kills spread over the whole job."""
    lo = 0.8 * first
    hi = max(first + 2 * (seconds - first) / max(n, 1), lo + 0.3)
    return [(SIGNALS[k % 3], rng.uniform(lo, hi), 0) for k in range(n)]
