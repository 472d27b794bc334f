"""``graphs.backend=auto``: a job's artifacts are captured before its first decode step, or not at
all, and the loop never waits on a compile after it; outputs equal the eager step's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyloop import LLM, SamplingParams

BASE = [
    "graphs.buckets=[4]",
    "graphs.kv_len_bucket=16",
    "model.max_context=128",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=256",
    "scheduler.max_running_requests=4",
    "cache.enable=false",
]
PROMPTS = [[5 + i, 9, 17, 33, 65, 129 - i] for i in range(4)]  # 6 tokens each
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def ids(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def eager_ids(tiny_ckpts: dict[str, Path]) -> list[list[int]]:
    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=eager", *BASE]) as llm:
        return ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


class CaptureLog:
    """Counts the decode steps a runner executes and when each artifact was built."""

    def __init__(self, llm: LLM) -> None:
        graphs = llm.graphs
        self.decode_steps = 0
        self.builds: list[tuple[int, int]] = []  # (kv_len bucket, decode steps run before it)
        execute, build = graphs.run, graphs.runner._build

        def counted(batch: Any, *args: Any, **kwargs: Any) -> Any:
            out = execute(batch, *args, **kwargs)
            self.decode_steps += batch.is_decode
            return out

        def logged(key: Any, static: Any) -> Any:
            self.builds.append((key.kv_len, self.decode_steps))
            return build(key, static)

        graphs.run = counted
        graphs.runner._build = logged


@pytest.mark.slow
def test_auto_captures_what_pays_before_the_first_decode_step(
    tiny_ckpts: dict[str, Path],
    eager_ids: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYLOOP_CACHE_DIR", str(tmp_path))
    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=auto", *BASE]) as llm:
        runner = llm.graphs
        assert runner.auto and runner.backend == "compile"
        # This machine's history says eager steps are slow and compiles cheap: capture pays.
        assert runner.history is not None
        runner.history.step_ms["eager"].update({1: 1e3, 4: 1e3})
        runner.history.capture_s["compile"] = {"b4_kv16": [0.01]}
        log = CaptureLog(llm)
        assert ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == eager_ids
        s = llm.stats()
        # kv_len 7..45 crosses two bucket edges: three artifacts, all built before step one.
        assert sorted(kv for kv, _ in log.builds) == [16, 32, 48]
        assert all(before == 0 for _, before in log.builds)
        assert s["uncaptured_steps"] == 0 and s["eager_fallbacks"] == 0
        assert s["graph_replays"] == 39 and s["recompiles"] == 0
        assert s["auto_plan"].startswith("3 of 3 artifacts") and s["auto_capture_s"] > 0
        # The next job plans afresh and reuses what is captured: nothing is built.
        assert ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == eager_ids
        assert len(log.builds) == 3 and llm.stats()["graph_replays"] == 78
    history = list((tmp_path / "steps").glob("*.json"))
    assert len(history) == 1 and '"compile"' in history[0].read_text()


def test_auto_runs_a_short_job_eagerly_and_keeps_its_step_times(
    tiny_ckpts: dict[str, Path],
    eager_ids: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYLOOP_CACHE_DIR", str(tmp_path))
    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=auto", *BASE]) as llm:
        log = CaptureLog(llm)
        assert ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == eager_ids
        s = llm.stats()
        assert log.builds == [] and s["graph_replays"] == 0 and s["capture_time"] == 0
        assert s["uncaptured_steps"] == 39
        assert s["auto_plan"].startswith("0 of 3 artifacts for ~39 decode steps")
        summary = llm.summary()
    assert "auto plan" in summary and "auto (compile where a job pays for it)" in summary
    (path,) = (tmp_path / "steps").glob("*.json")
    assert '"eager"' in path.read_text()  # measured for the next plan


@pytest.mark.slow
def test_warmup_captures_times_and_keeps_a_configs_artifacts(
    tiny_ckpts: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hyloop.cli import main
    from hyloop.graphs.capture.policy import StepHistory

    monkeypatch.setenv("HYLOOP_CACHE_DIR", str(tmp_path))
    # As in a new process: inductor's directory not chosen yet (earlier tests chose one).
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = str(tiny_ckpts["llama"])
    args = ["graphs.buckets=[2]", "graphs.kv_len_bucket=16", "model.max_context=64"]
    assert main(["warmup", "--model", model, "--kv-len", "20", "--no-progress", *args]) == 0
    out = capsys.readouterr().out
    assert "warmed 2 artifacts" in out  # kv_len buckets 16 and 32 at batch 2
    (path,) = (tmp_path / "steps").glob("*.json")
    history = StepHistory(path)
    captures = history.capture_s["compile"]
    assert set(captures) == {"b2_kv16", "b2_kv32"}
    assert len(captures["b2_kv16"]) == 2  # from nothing, then again with the cache warm
    assert set(history.step_ms["compile"]) == {2} and set(history.step_ms["eager"]) == {2}
    assert any((tmp_path / "inductor").iterdir())  # inductor's cache lives under ours
    # An auto engine of the same config reads these figures.
    with LLM(model=model, overrides=["graphs.backend=auto", *args]) as llm:
        est = llm.graphs.estimates()
        assert est.measured and est.captures.keys() == captures.keys()
