"""User calls from other threads: queued while a step runs, applied at the next step boundary."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM, SamplingParams
from hyloop.framework.engine import Engine

OVERRIDES = [
    "graphs.backend=eager",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=128",
    "scheduler.max_running_requests=8",
    "lookahead.min_batch=1",
]
CALL_AT = 6  # the step during which (or right after which) the calls are made


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def user_calls(eng: Engine) -> None:
    eng.add_request("late", prompt(9, 7), SamplingParams(temperature=0.9, seed=5, max_tokens=12))
    eng.abort_request("b")


def run(eng: Engine, during: Callable[[Engine], None] | None) -> list[tuple[int, Any]]:
    """Step to the end; make ``user_calls`` between steps CALL_AT and CALL_AT + 1 (``during``
    None) or from another thread while step CALL_AT runs. Returns (step, output) pairs."""
    for rid, seed in (("a", 1), ("b", 2), ("c", 3)):
        eng.add_request(
            rid, prompt(11 + seed, seed), SamplingParams(temperature=0.0, max_tokens=16, seed=seed)
        )
    log: list[tuple[int, Any]] = []
    step = 0
    while eng.has_unfinished_requests():
        step += 1
        if step == CALL_AT and during is not None:
            during(eng)
        for out in eng.step():
            sample = out.outputs[0]
            log.append(
                (step, (out.request_id, sample.token_ids, out.finished, sample.finish_reason))
            )
        if step == CALL_AT:
            if during is None:
                user_calls(eng)
            assert eng.request("late") is not None  # applied by the boundary
        eng.check_invariants()
        assert step < 500
    return log


def from_another_thread_during_the_step(seen: dict[str, Any]) -> Callable[[Engine], None]:
    """Wrap the pipeline's launch once: while the step runs, a thread makes the calls; what
    the engine held right after them goes into ``seen``."""
    return lambda eng: _wrap_launch(eng, seen)


def _wrap_launch(eng: Engine, seen: dict[str, Any]) -> None:
    real = eng.pipeline.launch

    def launch(*args: Any, **kwargs: Any) -> Any:
        eng.pipeline.launch = real  # type: ignore[method-assign]
        t = threading.Thread(target=user_calls, args=(eng,))
        t.start()
        t.join()  # the calls return at once: they are queued, not applied
        seen["late"] = eng.request("late")
        seen["b"] = eng.request("b").status.name  # type: ignore[union-attr]
        return real(*args, **kwargs)

    eng.pipeline.launch = launch  # type: ignore[method-assign]


@pytest.mark.parametrize("lookahead", [False, True])
def test_call_during_a_step_applies_at_the_next_boundary(
    tiny_ckpts: dict[str, Path], lookahead: bool
) -> None:
    overrides = [*OVERRIDES, f"lookahead.enable={str(lookahead).lower()}"]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        between = run(llm.engine, None)
    seen: dict[str, Any] = {}
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        during = run(llm.engine, from_another_thread_during_the_step(seen))
        assert llm.engine.stats()["requests_aborted"] == 1
    # While the step ran, neither call had touched the engine.
    assert seen == {"late": None, "b": "RUNNING"}
    assert during == between  # the same outputs, at the same steps
    finished = {o[0]: o for _, o in during if o[2]}
    assert finished["b"][3] == "abort" and finished["late"][3] in ("stop", "length")


def test_requests_added_from_a_thread_while_stepping(tiny_ckpts: dict[str, Path]) -> None:
    overrides = [*OVERRIDES, "lookahead.enable=true"]
    n = 24
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        eng = llm.engine
        eng.add_request("r0", prompt(8, 100), SamplingParams(temperature=0.0, max_tokens=6))
        errors: list[BaseException] = []

        def producer() -> None:
            try:
                for i in range(1, n):
                    eng.add_request(
                        f"r{i}",
                        prompt(5 + i % 7, 100 + i),
                        SamplingParams(temperature=0.0, max_tokens=6),
                    )
                    if i == 3:  # r3 needs several steps to finish: its id is still taken
                        with pytest.raises(ValueError, match="already in use"):
                            eng.add_request(
                                "r3", [5, 6], SamplingParams(temperature=0.0, max_tokens=2)
                            )
            except BaseException as e:  # reported on the main thread
                errors.append(e)

        t = threading.Thread(target=producer)
        t.start()
        done: set[str] = set()
        while t.is_alive() or eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done.add(out.request_id)
            eng.check_invariants()
        t.join()
        assert not errors
        assert done == {f"r{i}" for i in range(n)}
        assert eng.cache.kv.pending_size() == 0


@pytest.mark.parametrize("during", [False, True])
def test_abort_then_reuse_the_id(tiny_ckpts: dict[str, Path], during: bool) -> None:
    """``abort(x)`` then ``add_request(x)``: allowed between steps, and so during a step."""
    with LLM(model=tiny_ckpts["llama"], overrides=[*OVERRIDES, "lookahead.enable=true"]) as llm:
        eng = llm.engine
        eng.add_request("x", prompt(9, 1), SamplingParams(temperature=0.0, max_tokens=20, seed=1))
        for _ in range(3):
            eng.step()

        def calls(e: Engine) -> None:
            e.abort_request("x")
            e.add_request("x", prompt(7, 2), SamplingParams(temperature=0.0, max_tokens=4, seed=2))

        if during:
            real = eng.pipeline.launch

            def launch(*args: Any, **kwargs: Any) -> Any:
                eng.pipeline.launch = real  # type: ignore[method-assign]
                t = threading.Thread(target=calls, args=(eng,))
                t.start()
                t.join()
                return real(*args, **kwargs)

            eng.pipeline.launch = launch  # type: ignore[method-assign]
            eng.step()
        else:
            calls(eng)
        finished = []
        while eng.has_unfinished_requests():
            finished += [o for o in eng.step() if o.finished]
            eng.check_invariants()
        assert [(o.request_id, o.outputs[0].finish_reason) for o in finished] == [
            ("x", "abort"),
            ("x", "length"),
        ]
