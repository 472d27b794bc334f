"""Speculative decoding is exact: with n-gram drafts verified in one forward, every request
gives the tokens, logprobs and logits (bit for bit) it gives without speculation, greedy and
seeded sampled alike, with every generation control on, alone and batched, eager and under
lookahead, on a tiny dense checkpoint and on the SmolLM2 GGUF; the ledger holds after every
step; models whose state a verify step cannot roll back are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_DENSE, build_hf_checkpoint

from hyloop import LLM, SamplingParams
from hyloop.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

# every match drafted (``adaptive`` off): the verify path runs whatever the cost model says
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}
# Prompts that repeat themselves, so the drafts find matches (a random model repeats too).
PATTERN = [11, 23, 5, 17, 42, 8, 31]
PROMPTS = [PATTERN * 4, [7, 9, 7, 9, 7, 9, 13, 14, 15, 7, 9, 7], list(range(20, 60)) + PATTERN * 2]
EAGER = ["graphs.backend=eager", "model.max_context=256", "kv_pool.num_pages=1024"]


def controls(i: int, vocab: int) -> dict[str, Any]:
    """Request ``i``'s sampling: greedy or seeded sampled, each with generation controls on."""
    picks: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": 5 + i, "top_k": 20, "top_p": 0.9},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
        {"temperature": 0.7, "seed": 3, "presence_penalty": 0.5, "min_p": 0.05},
        {"temperature": 0.0, "min_tokens": 6, "stop_token_ids": [PATTERN[3]]},
        {"temperature": 0.8, "seed": 11, "logit_bias": {PATTERN[2]: 3.0, 2: -5.0}},
    ]
    return picks[i % len(picks)]


def run(llm: LLM, prompts: list[list[int]], kinds: list[int], max_tokens: int = 24) -> list[Any]:
    engine = llm.engine
    engine.capture_logits = True
    vocab = engine.vocab_size
    for i, (p, k) in enumerate(zip(prompts, kinds, strict=True)):
        params = SamplingParams(max_tokens=max_tokens, logprobs=2, **controls(k, vocab))
        engine.add_request(f"r{i}", p, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    engine.capture_logits = False
    outs = []
    for i in range(len(prompts)):
        o = done[f"r{i}"].outputs[0]
        lps = [e[t].logprob for e, t in zip(o.logprobs, o.token_ids, strict=True)]
        outs.append((list(o.token_ids), lps, o.finish_reason))
    return outs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("spec") / "llama", TINY_DENSE["llama"])


@pytest.fixture(scope="module")
def engines(ckpt: Path) -> Iterator[dict[str, LLM]]:
    llms = {
        "off": LLM(model=ckpt, overrides=EAGER),
        "on": LLM(model=ckpt, overrides=EAGER, speculative_config=SPEC),
        "lookahead": LLM(
            model=ckpt,
            overrides=[*EAGER, "lookahead.enable=true", "lookahead.min_batch=1"],
            speculative_config=SPEC,
        ),
    }
    yield llms
    for llm in llms.values():
        llm.close()


@pytest.mark.parametrize("loop", ["on", "lookahead"])
def test_speculation_gives_the_tokens_of_decoding_without_it(
    engines: dict[str, LLM], loop: str
) -> None:
    kinds = list(range(6))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in kinds]
    batched_off = run(engines["off"], prompts, kinds)
    before = engines[loop].stats()
    batched_on = run(engines[loop], prompts, kinds)
    after = engines[loop].stats()
    assert batched_on == batched_off
    for i, k in enumerate(kinds):  # alone: the same as in the batch
        assert run(engines[loop], [prompts[i]], [k]) == [batched_off[i]]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # the verify path ran and kept


def test_a_batch_without_features_samples_its_positions_in_one_call(
    engines: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy and seeded sampled rows with no feature (top-k and top-p are the sampler's) take
    the one-call path; their tokens and logprobs are decoding's without speculation."""
    import hyloop.framework.token_step as token_step

    paths: list[bool] = []
    inner = token_step.verify

    def spy(*args: Any) -> Any:
        paths.append(args[-1])
        return inner(*args)

    kinds = [0, 1, 0, 1]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    off = run(engines["off"], prompts, kinds)
    monkeypatch.setattr(token_step, "verify", spy)
    assert run(engines["on"], prompts, kinds) == off
    assert paths and all(paths), paths  # every verify step sampled its positions at once
    paths.clear()
    mixed = [0, 2]  # a penalty: positions one after another, counting the kept tokens
    assert run(engines["on"], prompts[:2], mixed) == run(engines["off"], prompts[:2], mixed)
    assert paths and not any(paths), paths


def test_verified_positions_have_the_plain_steps_logits_bit_for_bit(
    engines: dict[str, LLM],
) -> None:
    """Every logit a verify step computes for a kept position equals the plain decode step's."""
    kept = engines["on"].stats()["spec_accepted_tokens"]
    on, off = (greedy_logits(engines[name], PROMPTS[0], 20) for name in ("on", "off"))
    assert on.shape == off.shape == (20, engines["on"].engine.vocab_size)
    assert torch.equal(on, off)
    assert engines["on"].stats()["spec_accepted_tokens"] > kept  # verified positions were kept


def greedy_logits(llm: LLM, prompt: Any, n: int) -> torch.Tensor:
    """The logits of each of ``n`` greedy tokens of ``prompt``, as the engine sampled them."""
    engine = llm.engine
    engine.capture_logits = True
    engine.add_request("bits", prompt, SamplingParams(temperature=0.0, max_tokens=n))
    req = engine.request("bits")
    assert req is not None
    while engine.has_unfinished_requests():
        engine.step()
    engine.capture_logits = False
    return torch.stack(req.logits or [])


def test_a_hybrid_model_is_refused_with_the_reason(hybrid_ckpts: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="recurrent state"):
        LLM(model=hybrid_ckpts["qwen3_5"], overrides=EAGER, speculative_config=SPEC)


def test_another_method_is_refused() -> None:
    from hyloop.api.engine_args import EngineArgs
    from hyloop.framework.sampling_params import NotSupportedError

    with pytest.raises(NotSupportedError, match="eagle"):
        EngineArgs("x", speculative_config={"method": "eagle", "model": "m"}).to_overrides()


@pytest.fixture(scope="module")
def smol(gguf_path: Path) -> Iterator[dict[str, LLM]]:
    ov = ["graphs.backend=eager", "model.max_context=512"]
    llms = {"off": LLM(model=gguf_path, overrides=ov)}
    llms["on"] = LLM(model=gguf_path, overrides=ov, speculative_config=SPEC)
    # the default policy: drafts where the measured cost model says they pay
    llms["adaptive"] = LLM(model=gguf_path, overrides=ov, speculative_config={"method": "ngram"})
    yield llms
    for llm in llms.values():
        llm.close()


def test_smollm2_gguf_with_every_control_and_a_structured_output(smol: dict[str, LLM]) -> None:
    text = "The list: apples, pears, plums. Again the list: apples, pears, plums. Again:"
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "array", "items": {"type": "string"}}},
        "required": ["fruit"],
    }
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
        SamplingParams(temperature=0.8, seed=4, max_tokens=40, top_p=0.95, logprobs=1),
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            repetition_penalty=1.1,
            bad_words=[" pears"],
            min_tokens=5,
            stop=[" plums."],
        ),
        SamplingParams(
            temperature=0.7,
            seed=9,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=schema),
        ),
    ]
    got = {}
    for name, llm in smol.items():
        outs = llm.generate([text] * len(params), params, use_tqdm=False)
        got[name] = [
            (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs
        ]
        if name == "on":
            assert sum(o.metrics.num_draft_tokens for o in outs) > 0
            assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert got["on"] == got["off"] == got["adaptive"]


def test_compiled_verify_steps_equal_eager_with_no_recompile(ckpt: Path) -> None:
    """``graphs.backend=compile``: verify steps replay their own artifacts (a tokens bucket per
    draft count), the same tokens as decoding without speculation, nothing recompiled."""
    ov = [
        "graphs.backend=compile",
        "graphs.buckets=[4]",
        "model.max_context=256",
        "kv_pool.num_pages=1024",
    ]
    spec = {**SPEC, "num_speculative_tokens": 2}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    with LLM(model=ckpt, overrides=EAGER) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(model=ckpt, overrides=ov, speculative_config=spec) as llm:
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want
        stats = llm.stats()
        captured = llm.engine.graphs.runner.stats()["captured"]
    assert stats["recompiles"] == 0 and stats["spec_accepted_tokens"] > 0
    verified = {k[-1] for k in captured if len(k) == 6}  # the verify artifacts that ran
    assert verified and verified <= {2, 3}


def test_a_verify_step_with_every_control_is_capture_safe(engines: dict[str, LLM]) -> None:
    import dataclasses

    from hyloop.framework.batches import Batch, Chunk
    from hyloop.graphs.safety import check_capture_safe

    eng = engines["on"].engine
    kinds = list(range(6))
    for i in kinds:
        params = SamplingParams(max_tokens=20, **controls(i, eng.vocab_size))
        eng.add_request(f"safe-{i}", PROMPTS[i % len(PROMPTS)], params)
    running = eng.scheduler.running
    while len(running) < len(kinds) or not all(r.prefill_done and r.output_ids for r in running):
        eng.step()
    chunks = [Chunk(r, r.total_len - 1, 1) for r in running]
    for c in chunks[::2]:  # every other row drafts two tokens (any: only the shapes matter)
        c.drafts = [PATTERN[0], PATTERN[1]]
        c.length = 3
    batch = eng.kind.build(Batch(chunks, is_decode=True, verify=True))
    assert batch.verify and batch.penalized and batch.controlled
    inputs = dataclasses.replace(batch, pools=eng.kind.captured_pools)
    with torch.inference_mode():
        out = check_capture_safe(eng.kind.step, inputs)
    assert out.next_ids.shape == (len(kinds), 3) and out.accepted is not None
    eng.abort_request([f"safe-{i}" for i in kinds])
    while eng.has_unfinished_requests():
        eng.step()


def test_smollm2_gguf_verified_logits_are_the_plain_steps_bit_for_bit(smol: dict[str, LLM]) -> None:
    prompt = "one two three four five six. one two three four five six. one two three"
    before = smol["on"].stats()["spec_accepted_tokens"]
    on, off = (greedy_logits(smol[name], prompt, 24) for name in ("on", "off"))
    assert torch.equal(on, off)
    assert smol["on"].stats()["spec_accepted_tokens"] > before


def test_row_models_are_refused_and_the_summary_reports_speculation(
    row_ckpt: Path, engines: dict[str, LLM]
) -> None:
    with pytest.raises(ValueError, match="row \\(TTS\\) model"):
        LLM(model=row_ckpt, overrides=EAGER, speculative_config=SPEC)
    summary = engines["on"].summary()
    assert "speculative    ngram (k 4" in summary and "tokens per decode step" in summary
