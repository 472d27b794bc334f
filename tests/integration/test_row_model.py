"""Multi-channel row model: rows through the engine, captured step, lookahead and the UHRC."""

from __future__ import annotations

import pytest
import torch

from hyloop import LLM, SamplingParams
from hyloop.graphs.ops import HORNER_BASE, HORNER_MOD

END_ID = 2


def rand_rows(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 64, (n,), generator=g)
    codes = [torch.randint(0, 32, (n,), generator=g) for _ in range(3)]
    return torch.stack([text, *codes], 1).tolist()


def horner_key(row: list[int]) -> int:
    """Python bignum reference of a row's radix key: two Horner hashes above 2**62."""
    if row[0] == END_ID:
        return END_ID
    packed = 0
    for mod, base in ((HORNER_MOD, HORNER_BASE), (2**31 - 19, 998_244_353)):
        acc = 0
        for v in row:
            acc = (acc * base + v % mod) % mod
        packed = (packed << 31) | acc
    return 2**62 + packed


PARAMS = [
    SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10) for i in range(5)
]


@pytest.fixture(scope="module")
def eager_outputs(row_ckpt):
    prompts = [rand_rows(n, i) for i, n in enumerate([5, 17, 9, 1, 30])]
    with LLM(model=row_ckpt, overrides=["graphs.backend=eager"]) as llm:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        llm.engine.check_invariants()
    return prompts, outs


def test_rows_and_keys(eager_outputs) -> None:
    _, outs = eager_outputs
    for out in (o.outputs[0] for o in outs):
        assert out.rows is not None and len(out.rows) == len(out.token_ids)
        assert all(len(r) == 4 for r in out.rows)
        assert out.token_ids == [horner_key(r) for r in out.rows]
        if out.finish_reason == "stop":
            assert out.rows[-1][0] == END_ID and out.token_ids[-1] == END_ID


@pytest.mark.parametrize("lookahead", [False, True])
def test_compiled_and_lookahead_equal_eager(row_ckpt, eager_outputs, lookahead: bool) -> None:
    prompts, ref = eager_outputs
    overrides = [
        "graphs.backend=compile",
        "graphs.buckets=[2,4]",
        f"lookahead.enable={lookahead}",
        "lookahead.min_batch=1",
    ]
    with LLM(model=row_ckpt, overrides=overrides) as llm:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        llm.engine.check_invariants()
        assert llm.stats()["graph_replays"] > 0
        assert llm.stats()["recompiles"] == 0
    assert [o.outputs[0].rows for o in outs] == [o.outputs[0].rows for o in ref]


def test_prompt_rows_hit_the_cache(row_ckpt) -> None:
    turn1 = rand_rows(20, 50)
    with LLM(model=row_ckpt, overrides=["graphs.backend=eager", "kv_pool.page_size=1"]) as llm:
        out1 = llm.generate([turn1], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[
            0
        ]
        turn2 = turn1 + out1.outputs[0].rows + [[5, 1, 1, 1]]
        out2 = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[
            0
        ]
        llm.engine.check_invariants()
    # One key for a row however it arrives: a follow-up that re-sends turn 1's output as prompt
    # rows reuses turn 1's prompt and every generated row turn 1 computed (all but its last,
    # which was sampled and never fed back).
    assert out2.num_cached_tokens == len(turn1) + len(out1.outputs[0].rows) - 1


def test_bad_rows_fail_alone(row_ckpt) -> None:
    with LLM(model=row_ckpt, overrides=["graphs.backend=eager"]) as llm:
        with pytest.raises(ValueError, match="channel 2 id 40"):
            llm.engine.add_request("bad", [[3, 0, 40, 0]], SamplingParams())
        with pytest.raises(ValueError, match=r"expected \[L, 4\]"):
            llm.engine.add_request("bad2", [[3, 0, 0]], SamplingParams())
        out = llm.generate(
            [rand_rows(4, 1)], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False
        )[0]
        assert len(out.outputs[0].rows) == 3
        llm.engine.check_invariants()
