"""hyloop's thread pool for its CPU kernels (``cpu_pool.cpp``), through its probe
``hyloop::pool_cover``: every index of a job runs exactly once, on as many threads as torch's
thread count and the grain allow, back to back, from several Python threads at once, after
``torch.set_num_threads``, in a forked child, and with the pool turned off (OpenMP's path)."""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from hyloop.models.cpu import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)


def _cover(n: int, grain: int) -> tuple[torch.Tensor, int]:
    out = torch.ops.hyloop.pool_cover(n, grain)
    return out[:n], int(out[n])


@pytest.mark.parametrize(
    "n,grain", [(1, 1), (2, 1), (7, 1), (7, 3), (100, 1), (100, 60), (100, 100), (5000, 7)]
)
def test_every_index_runs_once_on_the_threads_the_grain_allows(n: int, grain: int) -> None:
    visits, threads = _cover(n, grain)
    assert torch.equal(visits, torch.ones(n, dtype=torch.long))
    assert threads == min(torch.get_num_threads(), math.ceil(n / grain))


def test_back_to_back_jobs_lose_nothing() -> None:
    for i in range(3000):
        visits, _ = _cover(64 + i % 7, 1)
        assert int(visits.min()) == 1 and int(visits.max()) == 1, f"job {i}"


def test_callers_on_several_threads_at_once() -> None:
    errors: list[str] = []

    def caller(seed: int) -> None:
        for i in range(300):
            n = 50 + (seed * 31 + i) % 200
            visits, _ = _cover(n, 3)
            if not torch.equal(visits, torch.ones(n, dtype=torch.long)):
                errors.append(f"caller {seed} job {i}: {visits.tolist()}")

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not errors, errors[:3]


def test_torch_thread_count_bounds_the_pool() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        visits, threads = _cover(1000, 1)
        assert threads == 1 and torch.equal(visits, torch.ones(1000, dtype=torch.long))
    finally:
        torch.set_num_threads(before)
    assert _cover(1000, 1)[1] == min(before, 1000)


def _child(queue: multiprocessing.Queue) -> None:
    visits, threads = _cover(500, 1)
    queue.put((bool(torch.equal(visits, torch.ones(500, dtype=torch.long))), threads))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_runs_jobs_of_its_own() -> None:
    _cover(500, 1)  # the parent's workers exist before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child hung in the pool")
    assert proc.exitcode == 0
    ok, threads = queue.get(timeout=10)
    assert ok and threads >= 1


def test_pool_off_takes_openmp_and_covers_the_same() -> None:
    code = (
        "import torch\n"
        "from hyloop.models.cpu import cpu_ops\n"
        "assert cpu_ops.ensure_loaded()\n"
        "out = torch.ops.hyloop.pool_cover(777, 5)\n"
        "assert torch.equal(out[:777], torch.ones(777, dtype=torch.long)), out\n"
        "print(int(out[777]))\n"
    )
    env = {**os.environ, "HYLOOP_CPU_POOL": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 1
