"""Batch jobs killed at random points and resumed equal an uninterrupted run (``kill_resume``).

``run-batch`` and ``generate`` on a tiny checkpoint (eager) get SIGKILL, SIGINT and SIGTERM at
random points, each followed by a rerun with ``--resume``; the last run finishes. The output
must equal a clean run's (but for ids, times and cache hits), hold each row once, and be alone in
its folder; each handled signal exits 130 / 143 with a summary line and no traceback. A last line
cut short is redone. ``bench/kill_resume.py`` runs the full-size version (200 rows, 10 kills).
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kill_resume import (
    command,
    compare,
    job_env,
    kill_and_resume,
    progress_kills,
    read_output,
    run,
    timed,
    write_rows,
)

pytestmark = pytest.mark.slow
ROWS, MAX_TOKENS, RUNNING = 48, 32, 2  # two rows a step: a job long enough to kill


def _clean(
    tmp_path: Path, job: str, model: Path, ray: int = 0
) -> tuple[Path, list[dict[str, Any]], float, float]:
    """The input, a clean run's output, its seconds and the seconds to its first line."""
    (tmp_path / "in").mkdir(exist_ok=True)
    src = write_rows(tmp_path / "in" / "rows.jsonl", job, ROWS, MAX_TOKENS)
    dst = tmp_path / "clean" / "out.jsonl"
    dst.parent.mkdir()
    env = job_env(tmp_path / "cache")
    seconds, first = timed(command(job, model, src, dst, ray, RUNNING), env, dst)
    return src, read_output(dst), seconds, first


def partial_output(cmd: list[str], env: dict[str, str], dst: Path) -> None:
    """SIGKILL the job once its output holds a third of the rows."""
    run(cmd, env, signal.SIGKILL, 0.0, (dst, ROWS // 3))
    assert 0 < len(dst.read_text().splitlines()) < ROWS


def _resumed(tmp_path: Path) -> Path:
    dst = tmp_path / "resumed" / "out.jsonl"
    dst.parent.mkdir()
    return dst


@pytest.fixture(scope="module")
def model(tiny_ckpts: dict[str, Path]) -> Path:
    return tiny_ckpts["llama"]


@pytest.mark.parametrize("job", ["run-batch", "generate"])
def test_killed_and_resumed_equals_an_uninterrupted_run(
    tmp_path: Path, model: Path, job: str
) -> None:
    src, clean, _, first = _clean(tmp_path, job, model)
    assert len(clean) == ROWS and all(line.get("error") is None for line in clean)
    kills = progress_kills(random.Random(f"{job}-kills"), 3, ROWS, first)
    dst = _resumed(tmp_path)
    env = job_env(tmp_path / "cache")
    attempts = kill_and_resume(command(job, model, src, dst, running=RUNNING), dst, env, kills)
    assert [p for a in attempts for p in a.problems] == []
    assert compare(clean, read_output(dst), dst) == []
    # Lines on disk only ever grow: every start kept what the one before it wrote.
    written = [a.lines_after for a in attempts]
    assert written == sorted(written) and written[-1] == ROWS
    assert not list((tmp_path / "cache" / "jobs").glob("*.json"))  # a finished job keeps none


def test_a_torn_last_line_is_redone(tmp_path: Path, model: Path) -> None:
    src, clean, _, first = _clean(tmp_path, "generate", model)
    dst = _resumed(tmp_path)
    env = job_env(tmp_path / "cache")
    cmd = command("generate", model, src, dst, running=RUNNING)
    partial_output(cmd, env, dst)
    whole = dst.read_text()
    done = len(whole.splitlines())
    with dst.open("a") as fh:  # what a kill inside a write leaves: half a line, no newline
        fh.write(whole.splitlines()[-1][:40])
    code, err = run(cmd, env, None, 0.0)
    assert code == 0, err
    out = read_output(dst)
    assert compare(clean, out, dst) == []
    assert out[:done] == [json.loads(x) for x in whole.splitlines()]


def test_resume_refuses_another_input_or_config(tmp_path: Path, model: Path) -> None:
    src, _, _, first = _clean(tmp_path, "run-batch", model)
    dst = _resumed(tmp_path)
    env = job_env(tmp_path / "cache")
    cmd = command("run-batch", model, src, dst, running=RUNNING)
    partial_output(cmd, env, dst)
    before = dst.read_bytes()
    other = write_rows(tmp_path / "in" / "other.jsonl", "run-batch", ROWS, MAX_TOKENS, seed=1)
    code, err = run(command("run-batch", model, other, dst, running=RUNNING), env, None, 0.0)
    assert code == 2 and "another input or config" in err, err
    code, err = run([*cmd, "sampling_defaults.temperature=0.5"], env, None, 0.0)
    assert code == 2 and "another input or config" in err, err
    code, err = run(cmd[: cmd.index("--resume")] + cmd[cmd.index("--resume") + 1 :], env, None, 0)
    assert code == 2 and "pass --resume" in err, err
    assert dst.read_bytes() == before  # refused: untouched


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (hyloop[ray])")
def test_ray_driver_killed_and_resumed(tmp_path: Path, model: Path) -> None:
    """Killed on two replicas and resumed, the output is a local run's (the two write the same
    lines: ``test_ray_batch``); both kills wait for lines, so the clean run's timing is not used."""
    src, clean, _, first = _clean(tmp_path, "generate", model)
    dst = _resumed(tmp_path)
    env = job_env(tmp_path / "cache")
    kills = progress_kills(random.Random("ray-kills"), 2, ROWS, first)
    cmd = command("generate", model, src, dst, ray=2, running=RUNNING)
    attempts = kill_and_resume(cmd, dst, env, kills)
    assert [p for a in attempts for p in a.problems] == []
    assert compare(clean, read_output(dst), dst) == []


def test_tts_killed_and_resumed(moss_local_ckpts: dict[str, Path], tmp_path: Path) -> None:
    rng = random.Random(0)
    rows = [
        {"id": f"t{i}", "rows": [[rng.randrange(3, 240), 16, 16, 16], [250, 1, 2, 3]]}
        for i in range(12)
    ]
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "tts.jsonl"
    params = {"max_frames": 24, "ignore_stop": True}
    src.write_text("".join(json.dumps({**r, **params}) + "\n" for r in rows))
    env = job_env(tmp_path / "cache")
    model = moss_local_ckpts["nvq3_v16_l1"]

    def cmd(dst: Path) -> list[str]:  # one line a batch: lines land one by one
        args = ["tts", "--model", str(model), "--input", str(src), "--output", str(dst)]
        opts = ["graphs.backend=eager", "scheduler.max_running_requests=1"]
        return [sys.executable, "-m", "hyloop.cli", *args, "--no-progress", "--resume", *opts]

    clean_dst = tmp_path / "clean" / "out.jsonl"
    clean_dst.parent.mkdir()
    _, first = timed(cmd(clean_dst), env, clean_dst)
    dst = _resumed(tmp_path)
    kills = progress_kills(random.Random("tts-kills"), 3, len(rows), first)
    attempts = kill_and_resume(cmd(dst), dst, env, kills)
    assert [p for a in attempts for p in a.problems] == []
    clean, got = read_output(clean_dst), read_output(dst)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    for a, b in zip(clean, got, strict=True):
        frames_a = np.load(clean_dst.parent / a.pop("frames"))
        frames_b = np.load(dst.parent / b.pop("frames"))
        assert a == b and frames_a.tolist() == frames_b.tolist()
    # Beside the output: its frame files only, one per line.
    names = ["out.jsonl", *(f"out.{i}.npy" for i in range(len(rows)))]
    assert sorted(p.name for p in dst.parent.iterdir()) == sorted(names)
