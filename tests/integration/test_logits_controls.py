"""The logits controls in the step, by vLLM's semantics, against transformers' processors on a
tiny checkpoint (with a word-level tokenizer, token ``i`` spelled ``w{i}``): ``logit_bias``,
``allowed_token_ids``, ``bad_words``, ``min_tokens`` and ``min_p``; then every control at once
(penalties and a structured output too) in a mixed batch: the same alone and batched, eager and
compiled, lookahead on and off, over 200 steps with no recompile, and capture-safe."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint, load_hf_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
)

from hyloop import LLM, SamplingParams
from hyloop.framework.requests import Batch, Chunk
from hyloop.graphs.safety import check_capture_safe
from hyloop.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 3, 12, 9, 9], [7, 7, 7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 10
BASE = ["model.max_context=128", "kv_pool.num_pages=512"]
EAGER = ["graphs.backend=eager", *BASE]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("logits_controls")
    model = build_hf_checkpoint(root / "llama", TINY_DENSE["llama"])
    vocab = TINY_DENSE["llama"]["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()  # token i's bytes: "w{i}" (grammars read them)
    tok.save(str(model / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    return load_hf_model(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    with LLM(model=ckpt, overrides=EAGER) as llm:
        yield llm


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kw)


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_greedy(hf: torch.nn.Module, new: int = NEW, **kw: Any) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=new,
                pad_token_id=0,
                **{"eos_token_id": None, "min_new_tokens": 0, **kw},
            )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def plain(llm: LLM) -> list[list[int]]:
    return run(llm, greedy())


def test_logit_bias_equals_sequence_bias(llm: LLM, hf: torch.nn.Module, plain: Any) -> None:
    firsts = {ids[0] for ids in plain}
    bias = {t: -50.0 for t in firsts} | {17: 3.0}
    ours = run(llm, greedy(logit_bias=bias))
    assert ours == hf_greedy(hf, sequence_bias={(t,): v for t, v in bias.items()})
    assert all(ids[0] not in firsts for ids in ours)  # the control did act


def test_allowed_token_ids_equal_a_prefix_constraint(llm: LLM, hf: torch.nn.Module) -> None:
    allowed = [11, 40, 77, 130, 201]
    ours = run(llm, greedy(allowed_token_ids=allowed))
    ref = hf_greedy(hf, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert ours == ref
    assert all(t in allowed for ids in ours for t in ids)


def test_bad_words_single_and_multi_token(llm: LLM, hf: torch.nn.Module, plain: Any) -> None:
    # The greedy outputs repeat a token: ban it after itself (two tokens), and ban one outright.
    pair = [plain[0][0], plain[0][0]]
    single = plain[1][0]
    words = [f"w{pair[0]} w{pair[1]}", f"w{single}"]
    ours = run(llm, greedy(bad_words=words))
    # No prompt ends with the pair's prefix, so matching the output only (vLLM) equals
    # transformers' matching of the whole sequence here.
    assert all(p[-1] != pair[0] for p in PROMPTS)
    assert ours == hf_greedy(hf, bad_words_ids=[pair, [single]])
    assert ours[0][:2] != pair and single not in ours[1]


def test_min_tokens_masks_eos_and_stop_ids(llm: LLM, hf: torch.nn.Module, plain: Any) -> None:
    stop = plain[0][0]  # the first prompt would stop at once without min_tokens
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop], min_tokens=4)
    ours = run(llm, params)
    eos = [stop, *llm.llm_engine.eos_ids]
    ref = hf_greedy(hf, eos_token_id=eos, min_new_tokens=4)
    trimmed = [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in ref]
    assert ours == trimmed
    assert len(ours[0]) >= 4 and stop not in ours[0][:4]


def test_min_p_draws_from_transformers_distribution(llm: LLM, hf: torch.nn.Module) -> None:
    """``min_p`` after the temperature (vLLM's order): the first token's frequencies over many
    seeds against transformers' warped distribution."""
    prompt, temp, min_p, n = PROMPTS[2], 0.3, 0.05, 600
    params = [
        SamplingParams(temperature=temp, min_p=min_p, seed=s, max_tokens=1, ignore_eos=True)
        for s in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = torch.zeros(TINY_DENSE["llama"]["vocab_size"])
    for o in outs:
        counts[o.outputs[0].token_ids[0]] += 1
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[:, -1].float()
    warp = LogitsProcessorList([TemperatureLogitsWarper(temp), MinPLogitsWarper(min_p)])
    probs = warp(torch.tensor([prompt]), logits).softmax(-1)[0]
    support = probs > 0
    assert 2 < int(support.sum()) < int((logits[0].softmax(-1) > 1e-4).sum())  # it filters
    assert counts[~support].sum() == 0  # nothing outside transformers' support
    tv = 0.5 * (counts / n - probs).abs().sum()
    assert tv < 0.08, f"total variation {tv:.3f}"


MIXED = [
    dict(logit_bias={17: 4.0, 40: -3.0}),
    dict(allowed_token_ids=[11, 40, 77, 130, 201], temperature=0.9, seed=3),
    dict(bad_words=["w135 w135", "w19"]),
    dict(min_tokens=5, stop_token_ids=[95], temperature=1.1, seed=5, max_tokens=12),
    dict(min_p=0.15, temperature=1.3, seed=7, top_k=20),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    dict(temperature=0.7, seed=11),  # no control at all
    dict(temperature=0.9, seed=13, structured_outputs=StructuredOutputsParams(regex="(w1[0-9])+")),
]


def mixed_params() -> list[SamplingParams]:
    out = []
    for kw in MIXED:
        kw = {"temperature": 0.0, "max_tokens": NEW, **kw}
        out.append(SamplingParams(**kw))
    return out


def mixed_run(model: LLM) -> list[list[int]]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(MIXED))]
    outs = model.generate(prompts, mixed_params(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mixed_controls_alone_equal_batched(llm: LLM) -> None:
    batched = mixed_run(llm)
    for i, params in enumerate(mixed_params()):
        alone = llm.generate([PROMPTS[i % len(PROMPTS)]], params, use_tqdm=False)
        assert list(alone[0].outputs[0].token_ids) == batched[i], MIXED[i]


@pytest.fixture(scope="module")
def compiled(ckpt: Path) -> Iterator[LLM]:
    overrides = [
        "graphs.backend=compile",
        "graphs.buckets=[8]",
        "lookahead.enable=false",
        "lookahead.min_batch=1",
        *BASE,
    ]
    with LLM(model=ckpt, overrides=overrides) as model:
        yield model


@pytest.mark.parametrize("lookahead", [False, True])
def test_mixed_controls_compiled_equal_eager(compiled: LLM, llm: LLM, lookahead: bool) -> None:
    eager = mixed_run(llm)
    compiled.llm_engine.set_lookahead(lookahead)
    hidden = compiled.stats().get("lookahead_hidden_host_s", 0.0)
    try:
        assert mixed_run(compiled) == eager
    finally:
        compiled.llm_engine.set_lookahead(False)
    stats = compiled.stats()
    assert stats["graph_replays"] > 0
    assert stats["eager_fallbacks"] == 0 and stats["recompiles"] == 0
    assert (stats.get("lookahead_hidden_host_s", 0.0) > hidden) == lookahead


def test_200_mixed_steps_no_recompile_no_fallback(compiled: LLM) -> None:
    """Waves of requests mixing every control, admitted as others finish, for 200 steps."""
    eng = compiled.llm_engine
    before = compiled.stats()
    params = mixed_params()
    added = steps = 0
    while steps < 200:
        while eng.get_num_unfinished_requests() < 8:
            p = dataclasses.replace(params[added % len(params)], max_tokens=5 + added % 17)
            if p.seed is not None:
                p.seed += added
            eng.add_request(f"wave-{added}", PROMPTS[added % len(PROMPTS)], p)
            added += 1
        eng.step()
        steps += 1
    while eng.has_unfinished_requests():
        eng.step()
    stats = compiled.stats()
    assert stats["graph_replays"] - before["graph_replays"] > 100  # the rest: prefill steps
    assert stats["eager_fallbacks"] == before["eager_fallbacks"] == 0
    assert stats["recompiles"] == 0 and stats["uncaptured_steps"] == 0
    eng.check_invariants()


def test_step_with_every_control_is_capture_safe(compiled: LLM) -> None:
    eng = compiled.llm_engine
    for i, p in enumerate(mixed_params()):
        eng.add_request(f"safe-{i}", PROMPTS[i % len(PROMPTS)], p)
    running = eng.scheduler.running
    while len(running) < len(MIXED) or not all(r.prefill_done and r.output_ids for r in running):
        eng.step()
    chunks = [Chunk(r, r.total_len - 1, 1) for r in running]
    batch = eng.kind.build(Batch(chunks, is_decode=True))
    assert batch.controlled and batch.penalized and batch.masked
    inputs = dataclasses.replace(batch, pools=eng.kind.captured_pools)
    with torch.inference_mode():
        out = check_capture_safe(eng.kind.step, inputs)
    assert out.next_ids.shape == (len(MIXED),)
    eng.abort_request([f"safe-{i}" for i in range(len(MIXED))])
    while eng.has_unfinished_requests():
        eng.step()
