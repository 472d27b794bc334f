"""``Engine.set_lookahead``: one engine switches loops between steps, never under a launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyloop import LLM, SamplingParams

OVERRIDES = ["graphs.backend=eager", "lookahead.min_batch=1", "cache.enable=true"]


def waves() -> list[list[list[int]]]:
    base = [7, 9, 11, 13, 15, 17]
    return [[base + [20 + w, 30 + i] for i in range(3)] for w in range(4)]


def test_switching_between_waves_keeps_outputs(tiny_ckpts: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, stop_token_ids=[40])
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=false"]) as ref:
        expected = [[o.token_ids for o in ref.generate(p, params, use_tqdm=False)] for p in waves()]
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=false"]) as llm:
        got = []
        for w, prompts in enumerate(waves()):
            llm.engine.set_lookahead(w % 2 == 0)
            assert (llm.engine.lookahead is not None) == (w % 2 == 0)
            got.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            llm.engine.check_invariants()
    assert got == expected


def test_switch_refused_while_a_step_is_in_flight(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=true"]) as llm:
        eng = llm.engine
        eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        while eng.lookahead is None or eng.lookahead.inflight is None:
            eng.step()
        with pytest.raises(RuntimeError, match="in flight"):
            eng.set_lookahead(False)
        eng.set_lookahead(True)  # already on: nothing to change
        assert eng.lookahead.inflight is not None


def test_switching_back_on_reuses_the_parked_thread(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=true"]) as llm:
        first = llm.engine.lookahead
        llm.engine.set_lookahead(False)
        llm.engine.set_lookahead(True)
        assert llm.engine.lookahead is first
