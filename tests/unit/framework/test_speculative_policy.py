"""The n-gram drafter and the drafting policy (``framework.speculative``), and the vLLM surface
of ``speculative_config``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hyloop.api.engine_args import EngineArgs
from hyloop.framework.config import ConfigError, load_config
from hyloop.framework.sampling_params import NotSupportedError
from hyloop.framework.speculative import MAX_BACKOFF, NgramDrafter, Speculator


def test_drafts_follow_the_latest_earlier_match_of_the_longest_ngram() -> None:
    d = NgramDrafter(1, 3)
    # "1 2 3" occurs at 0 (then 4 5) and at 6 (then 9): the latest earlier one wins
    history = [1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 7, 1, 2, 3]
    assert d.propose(history, 3) == [9, 7, 1]
    # the 2-gram "5 1" (then 8 2) wins over the later 1-gram "1" (then 6 5)
    d2 = NgramDrafter(1, 2)
    assert d2.propose([5, 1, 8, 2, 1, 6, 5, 1], 2) == [8, 2]
    # the drafts stop where the history does
    assert NgramDrafter(2, 2).propose([4, 6, 4, 6], 5) == [4, 6]


def test_no_match_no_drafts_and_the_index_grows_with_the_history() -> None:
    d = NgramDrafter(2, 3)
    history = [1, 2, 3, 4]
    assert d.propose(history, 4) == []
    history += [1, 2]
    assert d.propose(history, 4) == [3, 4, 1, 2]
    assert d.seen == len(history)


def request(prompt: list[int], out: list[int], max_new: int) -> Any:
    return SimpleNamespace(prompt_ids=prompt, output_ids=out, max_new=max_new, draft=None)


def test_drafts_stay_in_the_budget_and_failing_rows_back_off() -> None:
    section = load_config(None, ["speculative.method=ngram"]).speculative
    spec = Speculator(section)
    req = request([1, 2, 3, 4, 5, 1, 2], [], max_new=3)
    assert spec.propose(req) == [3, 4]  # 3 new tokens at most: 2 drafts and the one after
    req.max_new = 50
    waits = []
    for _ in range(8):  # every draft rejected: the waits double up to MAX_BACKOFF
        spec.record(req, drafted=2, accepted=0)
        waits.append(req.draft.wait)
        req.draft.wait = 0
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32] and MAX_BACKOFF == 32
    spec.record(req, drafted=4, accepted=4)
    assert req.draft.misses == 0 and req.draft.length == section.num_speculative_tokens
    spec.record(req, drafted=3, accepted=1)
    assert req.draft.length == 2  # what it accepted, plus one
    req.draft.wait = 2
    assert spec.propose(req) == [] and req.draft.wait == 1  # a waiting row skips a step
    assert spec.skips([req]) and req.draft.wait == 0  # a planned step counts too
    assert not spec.skips([req])


def test_vllm_speculative_config_maps_onto_the_section() -> None:
    args = EngineArgs(
        "m.gguf",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        },
    )
    cfg = load_config(None, args.to_overrides()).speculative
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 5, 4)
    assert cfg.prompt_lookup_min == 1
    # the CLI gives JSON
    ov = EngineArgs("m.gguf", speculative_config='{"method": "ngram"}').to_overrides()
    assert ov == ["model.path=m.gguf", "speculative.method=ngram"]
    with pytest.raises(NotSupportedError, match="draft_tensor_parallel_size"):
        EngineArgs(
            "m", speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1}
        ).to_overrides()
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        load_config(None, ["speculative.prompt_lookup_min=5", "speculative.prompt_lookup_max=2"])


def test_drafting_pauses_while_verify_steps_pay_less_than_plain_ones() -> None:
    from hyloop.framework.batches import Batch, Chunk

    spec = Speculator(load_config(None, ["speculative.method=ngram"]).speculative)
    req = request([1, 2, 3, 1, 2], [], max_new=50)
    plain = Batch([Chunk(req, 4, 1)], is_decode=True)
    spec.timed(plain, 0.010)  # 100 tokens a second
    verify = Batch([Chunk(req, 4, 3)], is_decode=True, verify=True)
    verify.chunks[0].taken = 1  # one token for a dearer step: 50 a second
    spec.timed(verify, 0.020)
    assert spec.pause == 8 and spec.losses == 1
    assert not spec.draft([Chunk(req, 4, 1)], [])  # paused: no drafts
    assert spec.pause == 7 and spec.skips([req]) and spec.pause == 6  # a planned step counts
    spec.pause = 0
    verify.chunks[0].taken = 3  # three tokens in 20 ms: 150 a second, averaged with 50
    spec.timed(verify, 0.020)
    assert spec.losses == 0 and spec.pause == 0
