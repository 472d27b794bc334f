"""The n-gram drafter and the drafting policy (``hyloop.speculative``), and the vLLM surface
of ``speculative_config``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hyloop.api.engine_args import EngineArgs
from hyloop.framework.batches import Batch, Chunk
from hyloop.framework.config import ConfigError, load_config
from hyloop.framework.sampling_params import NotSupportedError
from hyloop.speculative.policy import QUIET, QUIET_MAX, REMEASURE, NgramDrafter, Speculator


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


def speculator(k: int = 4) -> Speculator:
    section = load_config(
        None, ["speculative.method=ngram", f"speculative.num_speculative_tokens={k}"]
    )
    return Speculator(section.speculative)


def decode(reqs: list[Any]) -> list[Chunk]:
    return [Chunk(r, len(r.prompt_ids) + len(r.output_ids) - 1, 1) for r in reqs]


def test_drafts_stay_in_the_budget() -> None:
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 1, 2], [], max_new=3)
    assert spec.propose(req) == [3, 4]  # 3 new tokens at most: 2 drafts and the one after
    req.max_new = 1
    assert spec.propose(req) == []


def test_a_batch_size_runs_a_measured_plain_step_first_then_drafts_what_pays() -> None:
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50)
    chunks = decode([req])
    assert not spec.draft(chunks, [])  # batch size 1 not measured: a plain step
    spec.timed(Batch(chunks, is_decode=True), 0.010)
    chunks = decode([req])
    # prior acceptance 0.6 against 0.3 a position: 0.6 - 0.3, 0.96 - 0.6, 1.18 - 0.9: two drafts
    assert spec.draft(chunks, []) and chunks[0].drafts == [3, 4]
    spec.timed(Batch(chunks, is_decode=True, verify=True), 0.012)  # 1 ms a position
    assert spec.ratio(1) == pytest.approx(0.1)
    for _ in range(8):  # misses: the request's acceptance falls, and its match length's
        missed = decode([req])
        missed[0].drafts, missed[0].taken = [3, 4], 1
        spec.settle(missed)
    low = req.draft.rate
    assert low < 0.1 and spec.chance(req.draft) < spec.ratio(1)
    chunks = decode([req])
    assert not spec.draft(chunks, []) and chunks[0].drafts == []  # expected gain below cost
    assert low < req.draft.rate < 0.6  # untried, its acceptance drifts back towards the prior
    assert spec.quiet == QUIET and spec.skips() and spec.quiet == QUIET - 1
    tried = [spec.draft(decode([req]), []) for _ in range(40)]
    assert any(tried) and spec.quiet == 0  # it drafts again; lookahead drains for it
    assert spec.quiet_next == QUIET


def test_lookahead_drains_less_often_while_drafting_keeps_not_paying() -> None:
    """Each drained step that finds no draft worth it plans a longer stretch without drafts
    (fewer drains where drafts rarely match); a step that drafts starts over."""
    spec = speculator()
    miss = request([9, 8, 7, 6], [], max_new=500)  # no earlier match: no drafts
    spec.plain[1], spec.position[1], spec.since_plain[1] = 0.010, 0.001, 0
    stretches = []
    for _ in range(6):
        assert not spec.draft(decode([miss]), [])
        stretches.append(spec.quiet)
        while spec.skips():
            pass
    assert stretches == [QUIET, 2 * QUIET, 4 * QUIET, 8 * QUIET, 16 * QUIET, QUIET_MAX]
    hit = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50)
    assert spec.draft(decode([hit]), []) and spec.quiet == 0 and spec.quiet_next == QUIET


def test_a_new_request_ends_the_stretch_without_drafts_that_the_ones_before_left() -> None:
    """The last steps of a wave's requests have no room to draft, so their drained steps find
    no drafts and the stretches grow; the next wave's requests are new chances: their first
    step that finds no draft plans the shortest stretch, not the one left over."""
    spec = speculator()
    spec.plain[1], spec.position[1], spec.since_plain[1] = 0.010, 0.001, 0
    done = request([1, 2, 3, 4, 5, 6, 1, 2], [3], max_new=2)  # no room left to draft
    for _ in range(5):
        assert not spec.draft(decode([done]), [])
        while spec.skips():
            pass
    assert spec.quiet_next == QUIET_MAX
    fresh = request([9, 8, 7, 6], [], max_new=50)  # new, and no match yet
    assert not spec.draft(decode([fresh]), [])
    assert spec.quiet == QUIET and spec.quiet_next == 2 * QUIET
    later = request([9, 8, 7, 6], [], max_new=50)  # one that joins the running one
    assert not spec.draft(decode([fresh, later]), []) and spec.quiet == QUIET


def test_an_unmeasured_batch_size_drafts_on_the_costs_of_a_measured_size_near_it() -> None:
    """A wave's last requests end a few at a time: a batch size within ``NEAR`` of a measured
    one drafts at once on that size's costs (per row), and runs its own plain step after
    ``REMEASURE`` verify steps; a size far from every measured one runs a plain step first."""
    spec = speculator()
    spec.plain[16], spec.position[16], spec.since_plain[16] = 0.032, 0.0008, 0  # 0.4 a position
    spec.fixed[16] = 0.0
    hits = [request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50) for _ in range(14)]
    assert spec.measured(14) == 16 and spec.ratio(14) == pytest.approx(0.4)
    chunks = decode(hits)
    assert spec.draft(chunks, []) and [len(c.drafts) for c in chunks] == [1] * 14  # 0.6 > 0.4
    for _ in range(REMEASURE):
        spec.timed(Batch(chunks, is_decode=True, verify=True), 0.040)
    assert 14 not in spec.position  # no plain step of its own: its verify steps fit nothing
    assert not spec.draft(decode(hits), [])  # REMEASURE verify steps on borrowed costs
    spec.timed(Batch(decode(hits), is_decode=True), 0.028)
    assert spec.draft(decode(hits), [])  # measured: 14 drafts on 16's position cost still
    assert spec.measured(8) is None and spec.ratio(8) == pytest.approx(0.3)
    assert not spec.draft(decode(hits[:8]), [])  # 16 / 8 > NEAR: a plain step first


def test_each_row_keeps_the_drafts_that_beat_a_positions_cost_and_padding_costs_nothing() -> None:
    spec = speculator()
    hit = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50)
    miss = request([9, 8, 7, 6], [], max_new=50)  # no earlier match: no drafts
    spec.plain[2], spec.position[2], spec.since_plain[2] = 0.010, 0.001, 0
    # a position costs 0.001 / (0.010 / 2) = 0.2 tokens; the row without drafts pays nothing
    chunks = decode([hit, miss])
    assert spec.draft(chunks, [])
    assert [len(c.drafts) for c in chunks] == [3, 0]  # 0.6 ** 3 = 0.216 > 0.2 > 0.6 ** 4
    assert [c.length for c in chunks] == [4, 1]
    spec.position[2] = 0.002  # 0.4 a position: 0.6 > 0.4 > 0.36, one draft
    chunks = decode([hit, miss])
    assert spec.draft(chunks, []) and [len(c.drafts) for c in chunks] == [1, 0]
    # a verify step's measured cost is per draft it checked, not per row of the padded step
    spec.timed(Batch(chunks, is_decode=True, verify=True), 0.013)
    assert spec.position[2] == pytest.approx(0.7 * 0.002 + 0.3 * 0.003)
    spec.since_plain[2] = REMEASURE  # contexts grew: a plain step measures again
    assert not spec.draft(decode([hit, miss]), [])


def test_a_long_match_that_was_kept_drafts_more_than_a_short_one_that_was_not() -> None:
    """A row's chance blends its request's acceptance with that of proposals from as long a
    match: two new requests (the same acceptance), more drafts after the longer match."""
    section = load_config(
        None,
        [
            "speculative.method=ngram",
            "speculative.num_speculative_tokens=8",
            "speculative.prompt_lookup_min=1",
            "speculative.prompt_lookup_max=4",
        ],
    ).speculative
    spec = Speculator(section)
    spec.plain[2], spec.position[2], spec.since_plain[2] = 0.010, 0.001, 0  # 0.2 a position
    long = request([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], [], max_new=50)
    short = request([5, 7, 9, 8, 6, 5], [], max_new=50)
    chunks = decode([long, short])
    assert spec.draft(chunks, [])
    assert [long.draft.drafter.matched, short.draft.drafter.matched] == [4, 1]
    assert [len(c.drafts) for c in chunks] == [3, 3]  # untried lengths: the pooled 0.6 each
    for c, kept in zip(chunks, [2, 0], strict=True):  # the long match's drafts kept, not the other
        c.taken = 1 + kept
    spec.settle(chunks)
    first = [long.draft.rate, short.draft.rate]
    long.draft.kept, long.draft.verified = short.draft.kept, short.draft.verified  # alike
    assert spec.chance(long.draft) > spec.chance(short.draft), first
    chunks = decode([long, short])
    assert spec.draft(chunks, [])
    assert [len(c.drafts) for c in chunks] == [2, 1]


def test_drafting_that_stopped_everywhere_is_tried_again() -> None:
    """The engine's pooled acceptance, where new requests start, drifts back to the prior while
    proposals go untried: it cannot settle where no request ever drafts again."""
    spec = speculator()
    spec.plain[1], spec.position[1], spec.since_plain[1] = 0.010, 0.004, 0  # 0.4 a position
    spec.pooled = (0.2, 10.0)  # the engine's drafts mostly failed: acceptance 0.02
    req = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=500)  # starts at the pooled 0.02
    tried = [spec.draft(decode([req]), []) for _ in range(300)]
    assert not tried[0] and any(tried)
    assert spec.pooled[0] / spec.pooled[1] > 0.3


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


def test_a_measured_position_cost_drifts_back_to_the_prior_with_plain_steps() -> None:
    spec = speculator()
    spec.plain[2], spec.position[2] = 0.010, 0.050  # one costly verify step measured
    assert spec.ratio(2) == pytest.approx(10.0)
    req = request([1, 2], [], max_new=10)
    for _ in range(600):  # plain steps: drafting that stopped is tried again
        spec.timed(Batch(decode([req, req]), is_decode=True), 0.010)
    assert spec.ratio(2) < 0.35


def test_one_slow_step_moves_the_cost_model_by_at_most_thirty_percent() -> None:
    """A step slowed by something else (here 50x) is clipped to twice the average before it
    enters it, so drafting does not stop on its account; a fast one to half."""
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50)
    chunks = decode([req])
    spec.draft(chunks, [])
    spec.timed(Batch(chunks, is_decode=True), 0.010)  # plain: 10 ms
    chunks = decode([req])
    assert spec.draft(chunks, []) and len(chunks[0].drafts) == 2
    spec.timed(Batch(chunks, is_decode=True, verify=True), 0.012)  # 1 ms a position
    spec.timed(Batch(chunks, is_decode=True, verify=True), 0.500)  # 245 ms a position
    assert spec.position[1] == pytest.approx(0.0013)
    spec.timed(Batch(decode([req]), is_decode=True), 0.001)  # a plain step at a tenth
    assert spec.plain[1] == pytest.approx(0.0085)


def test_a_verify_step_runs_only_where_its_drafts_win_back_its_fixed_part() -> None:
    """What a verify step costs whatever its drafts (the intercept of its time over its
    drafts) must be paid by the expected kept drafts over their positions' cost, all rows
    together; else the step runs plain."""
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50)
    spec.draft(decode([req]), [])
    spec.timed(Batch(decode([req]), is_decode=True), 0.010)  # plain: 10 ms
    for drafts in (1, 2, 3, 4, 1, 2, 3, 4):  # a verify step: 4 ms + 1 ms a draft
        chunk = decode([req])[0]
        chunk.drafts = [7] * drafts
        spec.timed(Batch([chunk], is_decode=True, verify=True), 0.010 + 0.004 + 0.001 * drafts)
    assert spec.fixed[1] == pytest.approx(0.004)  # the intercept of 4 ms
    spec.position[1] = 0.001  # (the averaged slope, settled)
    assert spec.overhead(1) == pytest.approx(0.4)
    # acceptance 0.6 against 0.1 a position: four drafts worth 0.5 + 0.26 + 0.116 + 0.03 > 0.4
    chunks = decode([req])
    assert spec.draft(chunks, []) and len(chunks[0].drafts) == 4
    spec.fixed[1] = 0.010  # 1 token: not won back, a plain step without drafts
    chunks = decode([req])
    assert not spec.draft(chunks, []) and chunks[0].drafts == [] and chunks[0].length == 1
    spec.plain[2], spec.position[2], spec.since_plain[2] = 0.020, 0.001, 0
    spec.fixed[2] = 0.010  # 1 token of a two-row step: two rows' drafts pay it together
    chunks = decode([req, req])
    assert spec.draft(chunks, []) and [len(c.drafts) for c in chunks] == [4, 4]


def test_a_batch_size_measures_its_plain_step_anew_once_its_contexts_move() -> None:
    """A plain step's time follows its rows' contexts: once they moved by a quarter from the
    plain step that measured the batch size (a new wave, contexts grown), a plain step measures
    it again, and that measurement replaces the average."""
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 6, 1, 2], [], max_new=50)
    spec.draft(decode([req]), [])
    spec.timed(Batch(decode([req]), is_decode=True), 0.010)  # context 8
    assert spec.draft(decode([req]), [])  # 8 -> 8: drafts
    req.output_ids = [3, 4]  # context 10: a quarter more
    assert spec.draft(decode([req]), [])
    req.output_ids = [3, 4, 5]  # 11: moved by more than a quarter
    chunks = decode([req])
    assert not spec.draft(chunks, []) and chunks[0].drafts == []
    spec.timed(Batch(chunks, is_decode=True), 0.030)  # replaces the 10 ms (not averaged)
    assert spec.plain[1] == pytest.approx(0.030)
    spec.timed(Batch(chunks, is_decode=True), 0.040)  # the same contexts: averaged
    assert spec.plain[1] == pytest.approx(0.7 * 0.030 + 0.3 * 0.040)


def test_speculation_is_refused_off_the_cpu() -> None:
    from hyloop.speculative import speculator_for

    cfg = load_config(None, ["speculative.method=ngram", "device=cuda"])
    contract = SimpleNamespace(rows=None, recurrent=None)
    with pytest.raises(ValueError, match="exact on CPU only"):
        speculator_for(cfg, contract, swa_pool=False)  # type: ignore[arg-type]
    cpu = load_config(None, ["speculative.method=ngram"])
    assert isinstance(speculator_for(cpu, contract, swa_pool=False), Speculator)  # type: ignore[arg-type]
