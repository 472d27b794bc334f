"""A step whose launch raises leaves the engine usable: nothing parked or held for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyloop import LLM, SamplingParams


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("fail_at", [3, 6])  # a prefill-or-first decode launch, a continuation
def test_a_failed_launch_is_abandoned_cleanly(
    tiny_ckpts: dict[str, Path], lookahead: bool, fail_at: int
) -> None:
    overrides = [
        "graphs.backend=eager",
        "kv_pool.page_size=4",
        "kv_pool.num_pages=64",
        f"lookahead.enable={str(lookahead).lower()}",
        "lookahead.min_batch=1",
    ]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        eng = llm.engine
        graphs = eng.graphs
        real = graphs.run
        calls = 0

        def execute(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == fail_at:
                raise RuntimeError("injected launch failure")
            return real(*args, **kwargs)

        graphs.run = execute  # type: ignore[method-assign]
        for i in range(3):
            eng.add_request(
                f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=8)
            )
        failed = 0
        done = set()
        while eng.has_unfinished_requests():
            try:
                outs = eng.step()
            except RuntimeError as e:
                assert "injected" in str(e)
                failed += 1
                continue
            done |= {o.request_id for o in outs if o.finished}
            eng.check_invariants()
            assert len(eng.pipeline.unresolved()) <= 2
        assert failed == 1 and done == {"r0", "r1", "r2"}
        assert not eng.pipeline.unresolved() and eng.pipeline.fence.idle
        assert eng.scheduler.cache.kv.pending_size() == 0
        eng.check_invariants()
        # The engine still serves: a new request runs to its end.
        out = llm.generate(
            [[5, 6, 7]],
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        assert len(out[0].outputs[0].token_ids) == 4
