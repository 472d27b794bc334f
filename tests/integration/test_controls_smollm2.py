"""Every logits control on SmolLM2 (its GGUF), greedy ids against transformers' ``generate()``
on the same file with the matching processor; presence and frequency against a processor
written here from vLLM's formula; ``min_p`` as a distribution check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
)

from hyloop import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is", "Once upon a time, there was a"]
NEW = 12


@pytest.fixture(scope="module")
def gguf(gguf_path: Path) -> Path:
    return gguf_path


@pytest.fixture(scope="module")
def llm(gguf: Path) -> Iterator[LLM]:
    # transformers, the oracle, dequantizes the file
    overrides = ["graphs.backend=eager", "model.max_context=256", "model.weights=dequantize"]
    with LLM(model=gguf, overrides=overrides) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [list(llm.tokenizer.encode(t)) for t in TEXTS]


def ours(llm: LLM, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    kw = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, **kw}
    outs = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def theirs(hf: torch.nn.Module, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW,
                pad_token_id=0,
                **{"eos_token_id": None, **kw},
            )
        out.append(ids[0, len(p) :].tolist())
    return out


class OutputPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties, over the output tokens only."""

    def __init__(self, start: int, presence: float, frequency: float) -> None:
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.start :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def test_repetition_penalty(llm: LLM, hf: torch.nn.Module, prompts: Any) -> None:
    assert ours(llm, prompts, repetition_penalty=1.4) == theirs(hf, prompts, repetition_penalty=1.4)


def test_presence_and_frequency(llm: LLM, hf: torch.nn.Module, prompts: Any) -> None:
    got = ours(llm, prompts, presence_penalty=0.8, frequency_penalty=0.6)
    for p, ids in zip(prompts, got, strict=True):
        ref = theirs(
            hf, [p], logits_processor=LogitsProcessorList([OutputPenalties(len(p), 0.8, 0.6)])
        )
        assert ids == ref[0]
    assert got != ours(llm, prompts)  # the penalties changed something


def test_logit_bias_and_bad_words(llm: LLM, hf: torch.nn.Module, prompts: Any) -> None:
    plain = ours(llm, prompts)
    bias = {plain[0][0]: -30.0, plain[1][2]: -30.0}
    got = ours(llm, prompts, logit_bias=bias)
    assert got == theirs(hf, prompts, sequence_bias={(t,): v for t, v in bias.items()})
    assert got[0][0] != plain[0][0]
    # " Paris" / a word of the plain continuation, banned as vLLM tokenizes bad words
    word = llm.tokenizer.decode(plain[1][1:3]).strip()
    got = ours(llm, prompts, bad_words=[word])
    from hyloop.features.logits_controls import bad_word_ids

    banned = bad_word_ids([word], llm.tokenizer, "t")
    assert all(len(w) <= 2 for w in banned)
    for p, ids in zip(prompts, got, strict=True):
        # transformers matches the prompt too: the prompts here do not end in a word's prefix
        assert all(len(w) == 1 or p[-1] != w[0] for w in banned)
        assert ids == theirs(hf, [p], bad_words_ids=banned)[0]
    assert got[1] != plain[1]


def test_min_tokens(llm: LLM, hf: torch.nn.Module, prompts: Any) -> None:
    plain = ours(llm, prompts)
    stop = plain[0][1]  # would end the first prompt at its second token
    kw = dict(stop_token_ids=[stop], ignore_eos=False)
    got = ours(llm, prompts, min_tokens=5, **kw)
    eos = [stop, *llm.llm_engine.eos_ids]
    ref = theirs(hf, prompts, eos_token_id=eos, min_new_tokens=5)
    cut = [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in ref]
    assert got == cut
    assert len(got[0]) >= 5


def test_allowed_token_ids(llm: LLM, hf: torch.nn.Module, prompts: Any) -> None:
    allowed = sorted({t for ids in ours(llm, prompts) for t in ids})[:6]
    got = ours(llm, prompts, allowed_token_ids=allowed)
    assert got == theirs(hf, prompts, prefix_allowed_tokens_fn=lambda b, ids: allowed)
    assert all(t in allowed for ids in got for t in ids)


def test_min_p_distribution(llm: LLM, hf: torch.nn.Module, prompts: Any) -> None:
    prompt, temp, min_p, n = prompts[1], 1.0, 0.2, 600
    params = [
        SamplingParams(temperature=temp, min_p=min_p, seed=s, max_tokens=1, ignore_eos=True)
        for s in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = torch.zeros(llm.llm_engine.vocab_size)
    for o in outs:
        counts[o.outputs[0].token_ids[0]] += 1
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[:, -1].float()
    warp = LogitsProcessorList([TemperatureLogitsWarper(temp), MinPLogitsWarper(min_p)])
    probs = warp(torch.tensor([prompt]), logits).softmax(-1)[0]
    support = probs > 0
    assert 2 < int(support.sum()) < 200
    # the two models' logits differ in the last bits: a token within 3% of the threshold may
    # fall on either side
    plain = (logits[0] / temp).softmax(-1)
    ratio = plain / plain.max()
    border = (ratio > 0.97 * min_p) & (ratio < 1.03 * min_p)
    assert counts[~(support | border)[: counts.numel()]].sum() == 0
    tv = 0.5 * (counts / n - probs[: counts.numel()]).abs().sum()
    assert tv < 0.12, f"total variation {tv:.3f}"
