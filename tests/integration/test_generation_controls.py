"""Generation controls by vLLM's semantics, against transformers on a tiny checkpoint: the
repetition, frequency and presence penalties in the step (eager and compiled), ``n`` samples and
``best_of`` as seeded forks, and prompt logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint, load_hf_model
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from hyloop import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 3, 12, 9, 9], [7, 7, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 12
EAGER = ["graphs.backend=eager", "model.max_context=128", "kv_pool.num_pages=512"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("controls") / "llama", TINY_DENSE["llama"])


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    return load_hf_model(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    with LLM(model=ckpt, overrides=EAGER) as llm:
        yield llm


class _OutputPenalties(LogitsProcessor):
    """vLLM's frequency and presence penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, out, torch.ones_like(out, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], **kw: float) -> list[int]:
    procs = LogitsProcessorList()
    if kw.get("frequency") or kw.get("presence"):
        procs.append(
            _OutputPenalties(len(prompt), kw.get("frequency", 0.0), kw.get("presence", 0.0))
        )
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            repetition_penalty=kw.get("repetition", 1.0),
            logits_processor=procs,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


CASES = [
    {"repetition": 1.8},
    {"frequency": 1.5},
    {"presence": 2.0},
    {"repetition": 1.3, "frequency": 0.7, "presence": 0.5},
]


def _params(kw: dict[str, float]) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=NEW,
        ignore_eos=True,
        repetition_penalty=kw.get("repetition", 1.0),
        frequency_penalty=kw.get("frequency", 0.0),
        presence_penalty=kw.get("presence", 0.0),
    )


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "+".join(kw))
def test_penalties_equal_transformers(llm: LLM, hf: torch.nn.Module, kw: dict[str, float]) -> None:
    outs = llm.generate(PROMPTS, _params(kw), use_tqdm=False)
    plain = llm.generate(PROMPTS, _params({}), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, **kw)
    assert any(
        o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, plain, strict=True)
    )


def test_a_batch_mixing_penalized_and_plain_rows_keeps_each_rows_result(llm: LLM) -> None:
    mixed = [_params(CASES[3]), _params({}), _params(CASES[0])]
    together = llm.generate(PROMPTS, mixed, use_tqdm=False)
    alone = [llm.generate([p], s, use_tqdm=False)[0] for p, s in zip(PROMPTS, mixed, strict=True)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_compiled_step_with_penalties_equals_eager(ckpt: Path, llm: LLM) -> None:
    mixed = [_params(CASES[3]), _params({}), _params(CASES[1])]
    eager = llm.generate(PROMPTS, mixed, use_tqdm=False)
    overrides = ["graphs.backend=compile", "graphs.buckets=[4]", *EAGER[1:]]
    with LLM(model=ckpt, overrides=overrides) as compiled:
        outs = compiled.generate(PROMPTS, mixed, use_tqdm=False)
        assert compiled.stats()["graph_replays"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]


def test_n_samples_are_seeded_forks(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=NEW, seed=11, ignore_eos=True)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for j, sample in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, max_tokens=NEW, seed=11 + j, ignore_eos=True)
        ref = llm.generate([PROMPTS[2]], single, use_tqdm=False)[0]
        assert sample.token_ids == ref.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_best_of_keeps_the_most_likely_samples(llm: LLM) -> None:
    params = SamplingParams(
        n=2, best_of=4, temperature=1.0, max_tokens=NEW, seed=5, ignore_eos=True
    )
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1] and all(c.logprobs is None for c in out.outputs)
    every = []
    for j in range(4):
        one = SamplingParams(
            temperature=1.0, max_tokens=NEW, seed=5 + j, ignore_eos=True, logprobs=0
        )
        every.append(llm.generate([PROMPTS[0]], one, use_tqdm=False)[0].outputs[0])
    best = sorted(every, key=lambda c: -(c.cumulative_logprob or 0.0))[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]


def test_forks_share_the_prompt_through_the_cache(ckpt: Path) -> None:
    long_prompt = [(7 * i) % 200 + 3 for i in range(80)]
    with LLM(model=ckpt, overrides=[*EAGER, "cache.enable=true"]) as llm:
        params = SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=1)
        out = llm.generate([long_prompt], params, use_tqdm=False)[0]
        assert len(out.outputs) == 4
        assert llm.stats()["cached_tokens"] >= 3 * 64  # three forks hit the first one's prefix
        llm.engine.check_invariants()


def test_aborting_a_parent_aborts_its_forks(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("p", PROMPTS[0], SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort_request("p")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    finals = [o for o in outs if o.finished]
    assert [o.request_id for o in finals] == ["p"]
    assert {c.finish_reason for c in finals[0].outputs} == {"abort"}
    eng.check_invariants()


def test_prompt_logprobs_equal_transformers(ckpt: Path, hf: torch.nn.Module) -> None:
    prompt = PROMPTS[2] * 3
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    # Small prefill chunks: positions across chunk boundaries, and the cache warmed first.
    overrides = [*EAGER, "scheduler.prefill_chunk=8", "cache.enable=true"]
    with LLM(model=ckpt, overrides=overrides) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        llm.generate([prompt], greedy, use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    assert out.num_cached_tokens == 0  # prompt logprobs need every prompt position computed
    for pos in range(1, len(prompt)):
        entry, tok = lps[pos], prompt[pos]
        assert entry is not None and tok in entry
        assert entry[tok].logprob == pytest.approx(float(ref[pos - 1, tok]), abs=1e-4)
        assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        top = ref[pos - 1].topk(2).indices.tolist()
        assert set(top) <= set(entry) and all(entry[t].rank == r for r, t in enumerate(top, 1))


def test_n4_keeps_one_copy_of_the_prompt_and_one_abort_leaves_the_rest(ckpt: Path) -> None:
    """Pool use while four samples run: one copy of the prompt (the forks read the first one's
    through the tree and compute only its last position, whose logits they sample), plus each
    sample's own tokens; aborting sample 1 ends it alone."""
    long_prompt = [(7 * i) % 200 + 3 for i in range(96)]
    overrides = [*EAGER, "cache.enable=true", "kv_pool.page_size=1"]
    with LLM(model=ckpt, overrides=overrides) as llm:
        eng = llm.engine
        used0 = llm.stats()["kv_full_tokens_used"]
        params = SamplingParams(n=4, temperature=1.0, max_tokens=30, seed=2, ignore_eos=True)
        eng.add_request("p", long_prompt, params)
        outs = []
        while len(eng.scheduler.running) < 4 or any(
            len(r.output_ids) < 8 for r in eng.scheduler.running
        ):
            outs += eng.step()
        used = llm.stats()["kv_full_tokens_used"] - used0
        # each sample's own slots: its output budget (reserved at admission) and, for the
        # forks that hit the first one's prompt, the last prompt position they compute
        own = sum(r.max_new for r in eng.scheduler.running) + 3
        assert used <= len(long_prompt) + own, (used, own)
        assert sum(r.num_cached for r in eng.scheduler.running) == 3 * (len(long_prompt) - 1)
        eng.abort_request("1_p")
        while eng.has_unfinished_requests():
            outs += eng.step()
        final = [o for o in outs if o.finished]
        assert [o.request_id for o in final] == ["p"]
        reasons = [c.finish_reason for c in final[0].outputs]
        assert reasons == ["length", "abort", "length", "length"]
        assert [len(c.token_ids) for c in final[0].outputs if c.finish_reason == "length"] == [
            30
        ] * 3
        eng.check_invariants()
        assert llm.stats()["kv_full_tokens_used"] - used0 == eng.cache.tree.total_size()
