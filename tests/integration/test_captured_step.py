"""The engine's captured decode step: capture-safe end to end, no recompiles, no new memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hyloop import LLM, SamplingParams
from hyloop.framework.requests import Batch, Chunk
from hyloop.graphs.safety import CaptureSafetyError, check_capture_safe


def _decode_inputs(llm: LLM, n: int, prompt: object) -> object:
    """Admit ``n`` requests, prefill them, and build the StepBatch of their next decode step, as
    the captured step reads it (its compute path)."""
    eng = llm.engine
    for i in range(n):
        eng.add_request(f"safe-{i}", prompt, SamplingParams(max_tokens=8, temperature=0.7, seed=i))
    running = eng.scheduler.running
    while len(running) < n or not all(r.prefill_done and r.output_ids for r in running):
        eng.step()
    chunks = [Chunk(r, r.total_len - 1, 1) for r in eng.scheduler.running]
    batch = eng.kind.build(Batch(chunks, is_decode=True))
    return dataclasses.replace(batch, pools=eng.kind.captured_pools)


@pytest.mark.parametrize("which", ["llama", "qwen3_5", "row"])
def test_full_decode_step_is_capture_safe(tiny_ckpts, hybrid_ckpts, row_ckpt, which: str) -> None:
    ckpt: Path = {
        "llama": tiny_ckpts["llama"],
        "qwen3_5": hybrid_ckpts["qwen3_5"],
        "row": row_ckpt,
    }[which]
    prompt: object = [[5, 1, 2, 3]] * 7 if which == "row" else list(range(3, 40))
    with LLM(model=ckpt, overrides=["graphs.backend=compile", "graphs.buckets=[4]"]) as llm:
        inputs = _decode_inputs(llm, 3, prompt)
        with torch.inference_mode():
            out = check_capture_safe(llm.engine.kind.step, inputs)
        assert out.next_ids.shape == (3,)
        # The checker is live here: a planted host sync in the same step is caught.
        step = llm.engine.kind.step

        def planted(inp: object) -> object:
            res = step(inp)
            _ = int(res.next_ids[0])  # a host sync
            return res

        with pytest.raises(CaptureSafetyError), torch.inference_mode():
            check_capture_safe(planted, inputs)


def test_200_steps_no_recompile_no_new_pool_memory(tiny_ckpts) -> None:
    overrides = [
        "graphs.backend=compile",
        "graphs.buckets=[2,4]",
        "scheduler.max_running_requests=6",
    ]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        eng = llm.engine
        warm = [list(range(3, 10 + i)) for i in range(5)]
        llm.generate(
            warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        runner = eng.graphs.runner
        captured = set(map(tuple, runner.stats()["captured"]))
        # First-use compiles are counted apart from the step times.
        capture_s = eng.stats()["capture_time"]
        assert capture_s == pytest.approx(runner.capture_seconds) and capture_s > 0
        assert eng.stats()["decode_time"] < capture_s  # a few fast steps, not the compiles
        pools = [t.data_ptr() for t in eng.kind.pools.kv.k + eng.kind.pools.kv.v]
        table = eng.kind.pools.req_to_token.data_ptr()
        steps0 = eng.stats()["decode_steps"]
        # Changing batch sizes: staggered lengths make the decode batch shrink and grow.
        i = 0
        while eng.stats()["decode_steps"] - steps0 < 200:
            while len(eng.scheduler.running) + len(eng.scheduler.waiting) < 5:
                eng.add_request(
                    f"r{i}",
                    list(range(3, 8 + i % 9)),
                    SamplingParams(temperature=0.0, max_tokens=2 + i % 11),
                )
                i += 1
            eng.step()
        while eng.has_unfinished_requests():
            eng.step()
        s = eng.stats()
        assert s["recompiles"] == 0 and s["eager_fallbacks"] == 0
        assert s["graph_replays"] >= 200
        assert set(map(tuple, runner.stats()["captured"])) == captured  # nothing new compiled
        assert [t.data_ptr() for t in eng.kind.pools.kv.k + eng.kind.pools.kv.v] == pools
        assert eng.kind.pools.req_to_token.data_ptr() == table
        assert s["capture_time"] == capture_s  # no capture after warm-up
        eng.check_invariants()
