"""Same tokens on every run: the shipped SmolLM2 GGUF under the default config computes the same
greedy tokens batched and alone, eager and compiled, and in a first run on a machine (a fresh
``HYLOOP_CACHE_DIR``: hyloop's CPU kernels are built when the model loads) as in a warm one;
its run summary and stats name the numerics. (``bench/run_invariance.py`` runs the wider matrix:
busy machine, no compiler, bf16.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hyloop import LLM, SamplingParams
from hyloop.models.cpu import cpu_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
    ),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "SELECT name FROM users WHERE",
]
TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)

CHILD = r"""
import json, sys
from hyloop import LLM, SamplingParams
with LLM(model=sys.argv[1], overrides=["graphs.backend=eager"]) as llm:
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
    outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def eager(gguf_path: Path) -> tuple[list[list[int]], list[list[int]], str, str]:
    with LLM(model=gguf_path, overrides=["graphs.backend=eager"]) as llm:
        batched = _tokens(llm, PROMPTS)
        alone = [_tokens(llm, [p])[0] for p in PROMPTS]
        return batched, alone, llm.stats()["numerics"], llm.summary()


def test_a_prompt_alone_gets_the_batchs_tokens(eager: tuple) -> None:
    batched, alone, _, _ = eager
    assert all(len(t) == TOKENS for t in batched)
    assert alone == batched


def test_the_numerics_are_named(eager: tuple) -> None:
    _, _, numerics, summary = eager
    assert "int4 x120 + int8 x1: 16-bit activations per group of 32" in numerics
    assert "hyloop panels" in numerics
    assert f"numerics       weights=auto float32: {numerics}" in summary
    assert "never timed" in summary


def test_compiled_steps_get_the_eager_tokens(gguf_path: Path, eager: tuple) -> None:
    overrides = ["graphs.backend=compile", "graphs.buckets=[8]"]
    with LLM(model=gguf_path, overrides=overrides) as llm:
        assert _tokens(llm, PROMPTS) == eager[0]
        assert llm.stats()["graph_replays"] > 0


def test_a_first_run_on_a_machine_gets_a_warm_runs_tokens(
    gguf_path: Path,
    eager: tuple,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A fresh cache directory: the kernels are built at load (a line before, one with its
    seconds after), then the job computes what the warm process above computed. The build
    leaves the library and its lock alone beside each other, and a second caller finds it
    built: no second build, no line."""
    fresh = tmp_path / "fresh"
    env = {**os.environ, "HYLOOP_CACHE_DIR": str(fresh)}
    env.pop("HYLOOP_CPU_OPS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(gguf_path), json.dumps(PROMPTS), str(TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    assert "building the CPU kernels" in done.stderr
    assert re.search(r"CPU kernels built in \d+\.\d s", done.stderr), done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == eager[0]

    monkeypatch.setenv("HYLOOP_CACHE_DIR", str(fresh))
    path = cpu_ops.library_path()
    assert path.exists() and path.stat().st_size > 0
    assert {p.name for p in path.parent.iterdir()} == {path.name, path.with_suffix(".lock").name}
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler is not None  # the module's skip guarantees one
    capsys.readouterr()
    cpu_ops._build_once(compiler, path)  # already there: no second build
    assert "building" not in capsys.readouterr().err


def test_without_the_kernels_a_run_gets_the_kernels_tokens(gguf_path: Path, eager: tuple) -> None:
    """``HYLOOP_CPU_OPS=0`` (as on a machine without a compiler): every operator runs its torch
    definition (``models.cpu.numerics``, ``quant.reference``), slower, to the same tokens; the
    numerics line says which implementation ran."""
    env = {**os.environ, "HYLOOP_CPU_OPS": "0"}
    few, tokens = PROMPTS[:3], TOKENS // 2  # greedy: the first half of the warm run's tokens
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(gguf_path), json.dumps(few), str(tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    assert "torch ops compute the same numerics" in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [t[:tokens] for t in eager[0][:3]]
