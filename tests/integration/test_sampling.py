"""Sampling: seeds, batch invariance, temperature / top-k / top-p statistics, greedy, logprobs.

Statistical checks run on a tiny checkpoint with a 16-token vocab: the model's next-token
distribution for one prompt comes from transformers (its logits and its own logits warpers), then
hyloop samples that position once per seed. The noise is counter-based, so every count here is
deterministic; the bounds still leave room for an honest sampler and no room for a wrong one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint, load_hf_model
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hyloop import LLM, SamplingParams

SMALL_VOCAB = 16
STAT_PROMPT = [5, 9, 3, 12]
NUM_SAMPLES = 2000
# E[TV] of 2000 draws from this 16-way distribution is ~0.03; the power checks below show that
# a sampler using the wrong temperature or filter lands far outside this bound.
TV_BOUND = 0.05


@pytest.fixture(scope="module")
def small_vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = dict(TINY_DENSE["llama"], vocab_size=SMALL_VOCAB)
    return build_hf_checkpoint(tmp_path_factory.mktemp("v16") / "llama", cfg, seed=0)


@pytest.fixture(scope="module")
def ref_logits(small_vocab_ckpt: Path) -> torch.Tensor:
    hf = load_hf_model(small_vocab_ckpt)
    with torch.no_grad():
        return hf(torch.tensor([STAT_PROMPT])).logits[0, -1].float()


@pytest.fixture(scope="module")
def small_llm(small_vocab_ckpt: Path) -> Iterator[LLM]:
    overrides = [
        "graphs.backend=eager",
        "scheduler.max_running_requests=512",
        "model.max_context=32",
        "kv_pool.num_pages=4096",
    ]
    with LLM(model=small_vocab_ckpt, overrides=overrides) as llm:
        yield llm


LLM_OVERRIDES = [
    "graphs.backend=eager",
    "kv_pool.page_size=4",
    "kv_pool.num_pages=512",
    "scheduler.prefill_chunk=16",
]


@pytest.fixture(scope="module")
def llm(tiny_ckpts: dict[str, Path]) -> Iterator[LLM]:
    with LLM(model=tiny_ckpts["llama"], overrides=LLM_OVERRIDES) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_llama(tiny_ckpts: dict[str, Path]) -> torch.nn.Module:
    return load_hf_model(tiny_ckpts["llama"])


def hf_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The distribution transformers samples from: its warpers in its own order."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    warped = warpers(torch.tensor([STAT_PROMPT]), logits[None].clone())[0]
    return warped.softmax(-1)


_HISTOGRAMS: dict[tuple[int, tuple[tuple[str, float | int], ...]], torch.Tensor] = {}


def histogram(llm: LLM, **params: float | int) -> torch.Tensor:
    """Empirical next-token frequencies over NUM_SAMPLES seeds (memoised per setting)."""
    key = (id(llm), tuple(sorted(params.items())))
    if key not in _HISTOGRAMS:
        _HISTOGRAMS[key] = _sample_histogram(llm, **params)
    return _HISTOGRAMS[key]


def _sample_histogram(llm: LLM, **params: float | int) -> torch.Tensor:
    sps = [SamplingParams(max_tokens=1, seed=s, **params) for s in range(NUM_SAMPLES)]
    outs = llm.generate([STAT_PROMPT] * NUM_SAMPLES, sps, use_tqdm=False)
    counts = Counter(o.outputs[0].token_ids[0] for o in outs)
    hist = torch.zeros(SMALL_VOCAB)
    for tok, n in counts.items():
        hist[tok] = n
    return hist / NUM_SAMPLES


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def entropy(p: torch.Tensor) -> float:
    nz = p[p > 0]
    return float(-(nz * nz.log()).sum())


# -- greedy --------------------------------------------------------------------------------------
def test_greedy_is_argmax_for_every_seed(small_llm: LLM, ref_logits: torch.Tensor) -> None:
    hist = histogram(small_llm, temperature=0.0)
    assert hist[int(ref_logits.argmax())] == 1.0


def test_greedy_rows_beside_sampled_rows_follow_transformers(
    llm: LLM, hf_llama: torch.nn.Module
) -> None:
    prompts = [[7, 8, 9], [40, 41, 42, 43, 44, 45], [100] * 11]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=10, seed=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 2):
        ids = list(prompts[i])
        with torch.no_grad():
            for _ in range(10):
                ids.append(int(hf_llama(torch.tensor([ids])).logits[0, -1].argmax()))
        assert outs[i].outputs[0].token_ids == ids[len(prompts[i]) :], f"prompt {i}"


# -- seeds and batch invariance ------------------------------------------------------------------
TARGET_PROMPT = [11, 22, 33, 44, 55, 66, 77]
TARGET = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=12, seed=1234)


def _others(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(n)
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(1, 40, (1,), generator=g))
        prompts.append(torch.randint(3, 256, (length,), generator=g).tolist())
        temp = 0.0 if i % 3 == 0 else 1.3
        params.append(SamplingParams(temperature=temp, max_tokens=3 + i, seed=i, top_k=7 * i or -1))
        if i % 3 == 2:
            params[-1] = SamplingParams(temperature=0.6, top_p=0.5, max_tokens=9, seed=99)
    return prompts, params


def test_same_seed_same_tokens_whatever_the_batch(llm: LLM) -> None:
    alone = llm.generate([TARGET_PROMPT], TARGET, use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 12
    for n, where in [(1, 0), (3, 3), (9, 9)]:
        prompts, params = _others(n)
        prompts.insert(where, TARGET_PROMPT)
        params.insert(where, TARGET)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[where].outputs[0].token_ids == alone, f"batch of {n + 1}, target at {where}"


def test_same_seed_same_tokens_when_joining_midflight(llm: LLM) -> None:
    alone = llm.generate([TARGET_PROMPT], TARGET, use_tqdm=False)[0].outputs[0].token_ids
    eng = llm.engine
    prompts, params = _others(5)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"mid-other-{i}", p, sp)
    for _ in range(4):
        eng.step()
    eng.add_request("mid-target", TARGET_PROMPT, TARGET)
    eng.add_request("mid-twin", TARGET_PROMPT, TARGET)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["mid-target"].outputs[0].token_ids == alone
    assert done["mid-twin"].outputs[0].token_ids == alone


def test_same_seed_same_tokens_under_lookahead(llm: LLM, tiny_ckpts: dict[str, Path]) -> None:
    alone = llm.generate([TARGET_PROMPT], TARGET, use_tqdm=False)[0].outputs[0].token_ids
    prompts, params = _others(6)
    prompts.insert(2, TARGET_PROMPT)
    params.insert(2, TARGET)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    overrides = [*LLM_OVERRIDES, "lookahead.enable=true", "lookahead.min_batch=1"]
    with LLM(model=tiny_ckpts["llama"], overrides=overrides) as ahead:
        assert [
            o.outputs[0].token_ids for o in ahead.generate(prompts, params, use_tqdm=False)
        ] == plain
    assert plain[2] == alone


def test_different_seeds_differ(llm: LLM) -> None:
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in range(8)]
    outs = llm.generate([TARGET_PROMPT] * 8, params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 8


# -- temperature / top-k / top-p statistics -----------------------------------------------------
def test_temperature_one_matches_softmax(small_llm: LLM, ref_logits: torch.Tensor) -> None:
    hist = histogram(small_llm, temperature=1.0)
    assert tv(hist, hf_probs(ref_logits, 1.0)) < TV_BOUND
    assert tv(hist, hf_probs(ref_logits, 0.5)) > 2 * TV_BOUND  # power: the bound discriminates


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(
    small_llm: LLM, ref_logits: torch.Tensor, temperature: float
) -> None:
    hist = histogram(small_llm, temperature=temperature)
    assert tv(hist, hf_probs(ref_logits, temperature)) < TV_BOUND
    assert tv(hist, hf_probs(ref_logits, 1.0)) > 2 * TV_BOUND


def test_lower_temperature_is_more_peaked(small_llm: LLM, ref_logits: torch.Tensor) -> None:
    hists = [histogram(small_llm, temperature=t) for t in (0.05, 0.5, 1.0, 2.0)]
    ents = [entropy(h) for h in hists]
    assert ents == sorted(ents), ents
    top = int(ref_logits.argmax())
    # At T=0.05 the runner-up is exp(-gap / 0.05) less likely than the argmax: near-greedy.
    assert hists[0][top] >= 0.99
    assert abs(float(hists[0][top]) - float(hf_probs(ref_logits, 0.05)[top])) < 0.01


@pytest.mark.parametrize("k", [3, 6])
def test_top_k_stays_inside_the_top_k(small_llm: LLM, ref_logits: torch.Tensor, k: int) -> None:
    hist = histogram(small_llm, temperature=1.0, top_k=k)
    allowed = set(ref_logits.topk(k).indices.tolist())
    assert {int(t) for t in hist.nonzero().flatten()} == allowed
    assert tv(hist, hf_probs(ref_logits, 1.0, top_k=k)) < TV_BOUND


@pytest.mark.parametrize("size", [2, 4])
def test_top_p_stays_inside_the_nucleus(
    small_llm: LLM, ref_logits: torch.Tensor, size: int
) -> None:
    probs, order = ref_logits.softmax(-1).sort(descending=True)
    cum = probs.cumsum(0)
    # A top_p halfway between two cumulative masses: the nucleus has exactly `size` tokens and no
    # rounding can move its edge.
    top_p = float(cum[size - 2] + cum[size - 1]) / 2
    hist = histogram(small_llm, temperature=1.0, top_p=top_p)
    nucleus = set(order[:size].tolist())
    assert {int(t) for t in hist.nonzero().flatten()} == nucleus
    assert tv(hist, hf_probs(ref_logits, 1.0, top_p=top_p)) < TV_BOUND


def test_top_p_nucleus_taken_after_temperature(small_llm: LLM, ref_logits: torch.Tensor) -> None:
    ref = hf_probs(ref_logits, 2.0, top_p=0.5)
    hist = histogram(small_llm, temperature=2.0, top_p=0.5)
    assert {int(t) for t in hist.nonzero().flatten()} == {int(t) for t in ref.nonzero().flatten()}
    assert tv(hist, ref) < TV_BOUND


def test_top_k_then_top_p_like_transformers(small_llm: LLM, ref_logits: torch.Tensor) -> None:
    # transformers, vLLM and SGLang renormalise over the top-k before taking the nucleus.
    probs = ref_logits.softmax(-1).sort(descending=True).values
    k = 5
    renorm_cum = (probs[:k] / probs[:k].sum()).cumsum(0)
    top_p = float(renorm_cum[1] + renorm_cum[2]) / 2  # nucleus of 3 among the top 5
    ref = hf_probs(ref_logits, 1.0, top_k=k, top_p=top_p)
    assert int((ref > 0).sum()) == 3
    hist = histogram(small_llm, temperature=1.0, top_k=k, top_p=top_p)
    assert {int(t) for t in hist.nonzero().flatten()} == {int(t) for t in ref.nonzero().flatten()}
    assert tv(hist, ref) < TV_BOUND


# -- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_are_log_softmax_of_transformers_logits(
    llm: LLM, hf_llama: torch.nn.Module, k: int
) -> None:
    prompt = [3, 14, 15, 92, 65, 35]
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=7, logprobs=k, ignore_eos=True)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    with torch.no_grad():
        logits = hf_llama(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = logits[len(prompt) - 1 : -1].float().log_softmax(-1)
    for pos, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert tok in entry, f"position {pos}: sampled token missing"
        assert set(ref[pos].topk(k).indices.tolist()) <= set(entry)
        assert len(entry) in (k, k + 1)
        for tid, lp in entry.items():
            assert abs(lp.logprob - float(ref[pos, tid])) < 1e-4, f"position {pos}, token {tid}"


def test_no_logprobs_unless_asked(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.logprobs is None
