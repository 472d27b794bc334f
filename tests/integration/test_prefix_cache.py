"""UHRC end to end on a dense model: shared prefixes are computed once, outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from hyloop import LLM, SamplingParams

PREFIX = 300
N = 32


def shared_prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 256, (PREFIX,), generator=g).tolist()
    return [
        prefix + torch.randint(3, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 40, (N,), generator=g)
    ]


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_is_computed_once(tiny_ckpts, page_size: int) -> None:
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for enable in (True, False):
        overrides = [
            "graphs.backend=eager",
            f"kv_pool.page_size={page_size}",
            f"cache.enable={enable}",
        ]
        with LLM(model=tiny_ckpts["llama"], overrides=overrides) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.engine.check_invariants()
            runs[enable] = (outs, llm.stats())
    (on, stats_on), (off, stats_off) = runs[True], runs[False]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    unique = PREFIX + sum(len(p) - PREFIX for p in prompts)
    assert stats_on["prefill_tokens_computed"] <= unique + N * page_size
    assert stats_off["prefill_tokens_computed"] == sum(len(p) for p in prompts)
    hits = [o.num_cached_tokens for o in on]
    assert sum(h > 0 for h in hits) >= N - 1
    assert all(h == 0 or PREFIX - page_size < h <= PREFIX for h in hits)
    assert stats_on["cached_tokens"] == sum(hits)
    assert all(o.num_cached_tokens == 0 for o in off)


def test_multi_turn_reuses_the_whole_conversation(tiny_ckpts) -> None:
    """A follow-up that extends prompt + output hits everything the first turn computed."""
    g = torch.Generator().manual_seed(9)
    turn1 = torch.randint(3, 256, (50,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(
        model=tiny_ckpts["qwen3"], overrides=["graphs.backend=eager", "kv_pool.page_size=1"]
    ) as llm:
        out1 = llm.generate([turn1], params, use_tqdm=False)[0]
        turn2 = turn1 + out1.outputs[0].token_ids + [5, 6, 7]
        out2 = llm.generate([turn2], params, use_tqdm=False)[0]
        llm.engine.check_invariants()
        assert out2.num_cached_tokens == len(turn1) + len(out1.outputs[0].token_ids) - 1
    with LLM(
        model=tiny_ckpts["qwen3"], overrides=["graphs.backend=eager", "cache.enable=false"]
    ) as llm:
        again = llm.generate([turn2], params, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == out2.outputs[0].token_ids
