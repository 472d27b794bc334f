"""``Engine.set_lookahead``: one engine switches loops between steps, never under a launch."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from hyloop import LLM, SamplingParams

OVERRIDES = [
    "graphs.backend=eager",
    "lookahead.min_batch=1",
    "cache.enable=true",
    "kv_pool.num_pages=512",  # check_invariants walks the whole pool
]


def waves() -> list[list[list[int]]]:
    base = [7, 9, 11, 13, 15, 17]
    return [[base + [20 + w, 30 + i] for i in range(3)] for w in range(4)]


def test_switching_between_waves_keeps_outputs(tiny_ckpts: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, stop_token_ids=[40])
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=false"]) as ref:
        expected = [
            [o.outputs[0].token_ids for o in ref.generate(p, params, use_tqdm=False)]
            for p in waves()
        ]
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=false"]) as llm:
        got = []
        for w, prompts in enumerate(waves()):
            llm.engine.set_lookahead(w % 2 == 0)
            assert llm.engine.lookahead_enabled == (w % 2 == 0)
            hidden = llm.stats().get("lookahead_hidden_host_s", 0.0)
            got.append(
                [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            )
            ran = llm.stats().get("lookahead_hidden_host_s", 0.0) > hidden
            assert ran == (w % 2 == 0)  # the thread resolved steps exactly when on
            llm.engine.check_invariants()
    assert got == expected


def test_switching_at_random_steps_mid_run(tiny_ckpts: dict[str, Path]) -> None:
    """Requests keep running across switches: a switch lands whenever nothing is in flight
    (after a drain) and is refused otherwise; tokens and the ledger stay those of the sync loop."""
    rng = random.Random(5)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(4, 24), ignore_eos=True)
        for i in range(12)
    ]
    prompts = [[7, 9, 11, 13, 15, 17][: rng.randint(1, 6)] + [20 + i] for i in range(12)]
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=false"]) as ref:
        expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=false"]) as llm:
        eng = llm.engine
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(f"r{i}", prompt, p)
        done: dict[str, list[int]] = {}
        switched = refused = steps = 0
        while eng.has_unfinished_requests():
            want = rng.random() < 0.5
            try:
                eng.set_lookahead(want)
                switched += eng.lookahead_enabled == want
            except RuntimeError:
                refused += 1
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            eng.check_invariants()
            steps += 1
            assert steps < 2000, "no progress"
    assert [done[f"r{i}"] for i in range(12)] == expected
    assert switched and refused  # both outcomes exercised


def test_switch_refused_while_a_step_is_in_flight(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=true"]) as llm:
        eng = llm.engine
        eng.add_request(
            "a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        for _ in range(10):
            if eng.pipeline.unresolved():
                break
            eng.step()
        with pytest.raises(RuntimeError, match="in flight"):
            eng.set_lookahead(False)
        eng.set_lookahead(True)  # already on: nothing to change
        assert eng.lookahead_enabled and eng.pipeline.unresolved()


def _resolve_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hyloop-resolve")]


def test_switching_back_on_reuses_the_parked_thread(tiny_ckpts: dict[str, Path]) -> None:
    before = set(_resolve_threads())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=true"]) as llm:
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        first = set(_resolve_threads()) - before
        assert len(first) == 1  # the resolve thread of this engine
        hidden = llm.stats()["lookahead_hidden_host_s"]
        assert hidden > 0
        llm.engine.set_lookahead(False)
        llm.engine.set_lookahead(True)
        llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
        assert set(_resolve_threads()) - before == first  # the same thread, no second one
        assert llm.stats()["lookahead_hidden_host_s"] > hidden  # its counters carried over
        llm.engine.set_lookahead(False)
    # close() shut the parked loop's thread down too
    assert not any(t.is_alive() for t in first)
    with pytest.raises(RuntimeError, match="closed"):
        llm.engine.set_lookahead(True)


def test_set_lookahead_wants_a_bool(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=true"]) as llm:
        with pytest.raises(TypeError, match="bool"):
            llm.engine.set_lookahead("auto")  # type: ignore[arg-type]
        assert llm.engine.lookahead_enabled
