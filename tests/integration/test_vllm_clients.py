"""Programs written for vLLM, run on hyloop unchanged: lm-eval-harness's ``vllm`` backend (by
``python -m hyloop.compat.vllm lm_eval``) and hyloop's own lm-eval model (``python -m
hyloop.compat.lm_eval``, the GGUF read directly) against lm-eval's HF backend on the same
weights; outlines' ``from_vllm_offline`` with every output validated. Few items, to stay fast;
``bench/vllm_clients.py`` runs 20 of each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lm_eval_tasks as tasks  # noqa: E402

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

N_MC, N_GEN, N_ROLLING = 4, 3, 2
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tasks.write_tasks(tmp_path_factory.mktemp("tasks"), N_MC, N_GEN, N_ROLLING)


@pytest.fixture(scope="module")
def hf_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tasks.export_hf_dir(gguf_path, tmp_path_factory.mktemp("smollm2_hf"))


@pytest.fixture(scope="module", autouse=True)
def offline() -> Any:
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def hf_backend(task_dir: Path, model_args: str) -> dict[str, list[Any]]:
    """lm-eval's HF backend, in this process: the reference."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    result = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"{model_args},dtype=float32,device=cpu",
        tasks=list(tasks.TASKS),
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=1,
    )
    return tasks.responses(result["samples"])


def lm_eval_cli(route: list[str], model: str, model_args: str, task_dir: Path, out: Path) -> Any:
    """One ``lm_eval run`` in a fresh process by the documented route; its per-item responses."""
    cmd = [sys.executable, "-m", *route, "run", "--model", model, "--model_args", model_args]
    cmd += ["--tasks", *tasks.TASKS, "--include_path", str(task_dir), "--batch_size", "auto"]
    cmd += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return tasks.responses(tasks.read_logged_samples(out))


def assert_same_answers(got: dict[str, list[Any]], ref: dict[str, list[Any]]) -> None:
    assert len(got["hy_mc"]) == N_MC and len(got["hy_gen"]) == N_GEN
    for item, (a, b) in enumerate(zip(got["hy_mc"], ref["hy_mc"], strict=True)):
        assert a.index(max(a)) == b.index(max(b)), (item, a, b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (item, a, b)
    assert got["hy_gen"] == ref["hy_gen"]
    for a, b in zip(got["hy_rolling"], ref["hy_rolling"], strict=True):
        assert abs(a - b) < 1e-3, (a, b)  # a sum over every token of the text


@pytest.fixture(scope="module")
def hf_answers(hf_dir: Path, task_dir: Path) -> dict[str, list[Any]]:
    """lm-eval's HF backend on the weights transformers reads from the GGUF (``hf_dir`` is what
    it wrote of them): the reference of both routes below."""
    return hf_backend(task_dir, f"pretrained={hf_dir}")


def test_lm_eval_vllm_backend_equals_hf(
    hf_dir: Path, task_dir: Path, tmp_path: Path, hf_answers: dict[str, list[Any]]
) -> None:
    route = ["hyloop.compat.vllm", "lm_eval"]
    args = f"pretrained={hf_dir},dtype=float32,enforce_eager=True"
    got = lm_eval_cli(route, "vllm", args, task_dir, tmp_path)
    assert_same_answers(got, hf_answers)


def test_lm_eval_hyloop_model_on_gguf_equals_hf(
    gguf_path: Path, task_dir: Path, tmp_path: Path, hf_answers: dict[str, list[Any]]
) -> None:
    args = f"pretrained={gguf_path},model.weights=dequantize,enforce_eager=True"
    got = lm_eval_cli(["hyloop.compat.lm_eval"], "hyloop", args, task_dir, tmp_path)
    assert_same_answers(got, hf_answers)


# -- outlines -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outlines_model(gguf_path: Path) -> Any:
    pytest.importorskip("outlines")
    from hyloop.compat import vllm as alias

    alias.install()
    import outlines
    from vllm import LLM  # the alias: hyloop's LLM

    llm = LLM(str(gguf_path), enforce_eager=True, max_model_len=2048)
    yield outlines.from_vllm_offline(llm)
    llm.close()
    alias.uninstall()


def _seeded(seed: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.8, seed=seed, max_tokens=100)


def test_outlines_json_schema_closes_with_listed_keys_only(outlines_model: Any) -> None:
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    for seed in range(3):
        text = outlines_model("Describe a person as JSON.", Person, sampling_params=_seeded(seed))
        data = json.loads(text)  # complete within 100 tokens
        assert sorted(data) == ["age", "city", "name"], text
        Person.model_validate(data)


def test_outlines_regex_and_choice(outlines_model: Any) -> None:
    from outlines.types import Regex

    for seed in range(3):
        number = outlines_model("2+2=", Regex(r"[0-9]{1,3}"), sampling_params=_seeded(seed))
        assert re.fullmatch(r"[0-9]{1,3}", number), number
        answer = outlines_model(
            "Is the sky blue?", Literal["yes", "no"], sampling_params=_seeded(seed)
        )
        assert answer in ("yes", "no"), answer
