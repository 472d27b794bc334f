"""``hyloop regress``: the captured decode step matches the eager oracle token for token on tiny
dense and hybrid models (page_size 1 and 16, greedy and seeded sampling, batches around every
bucket edge), and a deliberately wrong captured step fails with exit 1 and its first divergence.

Compiling is slow on 2 cores (tens of seconds per artifact set), so the buckets are [2, 4] at
most, requests are short and the CLI runs in-process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM
from hyloop.cli import main
from hyloop.framework.config import CONFIG_DIR
from hyloop.recipes.graph_vs_eager import compare, load_recipe, run_regress

RECIPE = str(CONFIG_DIR / "recipes/graph_vs_eager.yaml")
SMALL = [
    "regress.max_tokens=4",
    "regress.prompt_len=[3,20]",
    "model.max_context=64",
    "graphs.backend=compile",
]


def regress_report(tmp_path: Path, ckpt: Path, *overrides: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "report.json"
    argv = ["regress", "--config", RECIPE, "--model", str(ckpt), "--json", str(out)]
    rc = main([*argv, *SMALL, *overrides])
    return rc, json.loads(out.read_text())


def assert_clean_pass(rc: int, report: dict[str, Any], labels: list[str]) -> None:
    assert report["failures"] == [] and report["passed"] and rc == 0
    assert report["backend"] == "compile"
    assert report["modes"] == ["greedy", "seed=0"]
    assert [r["bucket"] for r in report["per_bucket"]] == labels
    for row in report["per_bucket"]:
        assert row["exact_match_rate"] == 1.0 and row["first_divergence"] is None
        assert row["graph_replays"] > 0 and row["eager_fallbacks"] == 0
        assert row["max_logit_diff"] < 1e-3
    for wave in report["waves"]:
        assert wave["decode_batch"] == wave["batch"]  # the wave really decoded N at once
        # One replay per decode step (two for a split batch), none missing.
        pieces = 2 if wave["bucket"].startswith(">") else 1
        assert wave["graph_replays"] == pieces * (report["max_tokens"] - 1)
    assert report["graph_report"]["eager_fallbacks"] == 0
    assert report["graph_report"]["recompiles"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("page_size", "cpu_ops"), [(1, True), (16, True), (16, False)])
def test_dense_captured_equals_eager(
    tiny_ckpts: dict[str, Path], tmp_path: Path, page_size: int, cpu_ops: bool
) -> None:
    """``cpu_ops``: decode attention through hyloop's C++ kernel, or inductor's code / torch."""
    rc, report = regress_report(
        tmp_path,
        tiny_ckpts["llama"],
        "graphs.buckets=[2,4]",
        f"kv_pool.page_size={page_size}",
        f"model.cpu_ops={str(cpu_ops).lower()}",
    )
    assert report["batch_sizes"] == [1, 2, 3, 4, 5]
    assert report["page_size"] == page_size
    assert_clean_pass(rc, report, ["2", "4", ">4"])
    captured = {tuple(k[:2]) for k in report["graph_report"]["captured"]}
    assert captured == {(2, 64), (4, 64)}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_hybrid_captured_equals_eager(
    hybrid_ckpts: dict[str, Path], tmp_path: Path, page_size: int
) -> None:
    # One bucket keeps the hybrid compile affordable; batch 3 still straddles its edge (split).
    rc, report = regress_report(
        tmp_path, hybrid_ckpts["qwen3_5"], "graphs.buckets=[2]", f"kv_pool.page_size={page_size}"
    )
    assert report["batch_sizes"] == [1, 2, 3]
    assert_clean_pass(rc, report, ["2", ">2"])


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_row_model_captured_equals_eager(row_ckpt: Path, tmp_path: Path, page_size: int) -> None:
    """Multi-channel rows: the Horner row keys computed inside the captured step match eager."""
    rc, report = regress_report(
        tmp_path, row_ckpt, "graphs.buckets=[2]", f"kv_pool.page_size={page_size}"
    )
    assert_clean_pass(rc, report, ["2", ">2"])


def flip_captured_tokens(llm: LLM) -> None:
    """Shift every captured logit row at output position 1 (tokens unchanged: sampling is
    shift-invariant) and flip the captured token at position 2. The eager engine is untouched."""
    runner = llm.graphs.runner
    assert runner is not None
    replay = runner.run
    vocab = llm.engine.vocab_size

    def run(inputs: Any, *args: Any) -> Any:
        out = replay(inputs, *args)
        pos = inputs.out_pos
        out.logits = out.logits + 0.5 * (pos == 1).to(out.logits.dtype)[:, None]
        out.next_ids = torch.where(pos == 2, (out.next_ids + 1) % vocab, out.next_ids)
        return out

    runner.run = run  # type: ignore[method-assign]


@pytest.mark.slow
def test_perturbed_captured_step_fails(
    tiny_ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    args = argparse.Namespace(
        config=[RECIPE],
        model=str(tiny_ckpts["llama"]),
        json=str(out),
        overrides=[*SMALL, "graphs.buckets=[2]", "regress.logit_atol=0.1"],
    )
    assert run_regress(args, perturb=flip_captured_tokens) == 1
    report = json.loads(out.read_text())
    assert not report["passed"]
    for row in report["per_bucket"]:
        assert row["exact_match_rate"] == 0.0  # every request flipped at position 2
        assert row["first_divergence"]["position"] == 2
        assert row["max_logit_diff"] == pytest.approx(0.5, abs=1e-3)
        assert row["eager_fallbacks"] == 0 and row["graph_replays"] > 0
    first = report["per_bucket"][0]["first_divergence"]
    assert first["request"] == "greedy-b1-0"
    assert first["captured"] == (first["eager"] + 1) % 256
    text = capsys.readouterr().out
    assert "FAIL" in text and "greedy-b1-0 position 2" in text and "> 0.1" in text


def test_compare_against_plain_lists() -> None:
    """Divergence bookkeeping on hand-written sequences."""
    z = [torch.zeros(3)] * 4
    ref = ([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [z, z, z[:2]])
    bumped = [torch.zeros(3), torch.tensor([0.0, 0.25, 0.0]), torch.full((3,), 9.0), z[0]]
    got = ([[1, 2, 3, 4], [5, 6, 0, 8], [9]], [z, bumped, z[:1]])
    res = compare(["a", "b", "c"], ref, got)
    assert res["requests"] == 3 and res["exact"] == 1
    # Request b diverges at 2 (its logits count up to and including 2), c ends early at 1.
    assert res["first"] == {"request": "c", "position": 1, "eager": 9, "captured": None}
    assert res["max_logit_diff"] == 9.0


BAD_INPUTS = [
    (["regress.bogus=1"], "regress.bogus"),
    (["regress.max_tokens=1"], "regress.max_tokens"),
    (["regress.prompt_len=[9,3]"], "prompt_len"),
    (["graphs.backend=eager"], "graphs.backend"),
    (["graphs.bakend=compile"], "graphs.bakend"),
    (["regress.batch_sizes=[40]", "scheduler.max_running_requests=8"], "max_running_requests"),
    (["regress.prompt_len=[4,60]", "model.max_context=64"], "model.max_context=64"),
]


@pytest.mark.parametrize(("overrides", "named"), BAD_INPUTS)
def test_bad_input_exits_2(
    tiny_ckpts: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    overrides: list[str],
    named: str,
) -> None:
    argv = ["regress", "--config", RECIPE, "--model", str(tiny_ckpts["llama"]), *overrides]
    assert main(argv) == 2
    assert named in capsys.readouterr().err


def test_recipe_preset_loads() -> None:
    cfg, settings = load_recipe([RECIPE])
    assert cfg.graphs.backend == "auto" and settings.checkpoint is None
    assert settings.greedy and settings.seeds == [0] and settings.max_tokens >= 2
