"""``SamplingParams.output_kind``: streamed outputs every step, or only the finished one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyloop import LLM, RequestOutput, SamplingParams


def drive(llm: LLM, kind: str) -> list[RequestOutput]:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind)  # type: ignore[arg-type]
    eng.add_request("a", [5, 6, 7], params)
    eng.add_request("b", [9, 10], params)
    outs: list[RequestOutput] = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "lookahead"])
def test_final_only_returns_the_same_finals_and_nothing_else(
    tiny_ckpts: dict[str, Path], lookahead: bool
) -> None:
    overrides = ["graphs.backend=eager", f"lookahead.enable={str(lookahead).lower()}"]
    overrides.append("lookahead.min_batch=1")
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
        streamed = drive(llm, "cumulative")
        finals = drive(llm, "final_only")
    assert all(o.finished for o in finals) and len(finals) == 2
    running = [o for o in streamed if not o.finished]
    assert running, "cumulative outputs stream while running"
    for o in running:  # each streamed output holds the tokens so far
        final = next(f for f in streamed if f.finished and f.request_id == o.request_id)
        ids = o.outputs[0].token_ids
        assert final.outputs[0].token_ids[: len(ids)] == ids
    by_id = {o.request_id: o.outputs[0].token_ids for o in streamed if o.finished}
    assert {o.request_id: o.outputs[0].token_ids for o in finals} == by_id


def test_output_kind_is_validated(tiny_ckpts: dict[str, Path]) -> None:
    with LLM(model=tiny_ckpts["llama"], overrides=["graphs.backend=eager"]) as llm:
        bad = SamplingParams(output_kind="bogus")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="output_kind"):
            llm.engine.add_request("x", [5, 6], bad)
