"""Greedy parity with HF transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import pytest
import torch
from conftest import load_hf_model

from hyloop import LLM, SamplingParams

PROMPT_LENS = [1, 5, 16, 17, 31, 40, 70, 100]  # around a page (16) and a chunk (32)
NEW_TOKENS = 32


def hf_greedy(hf_model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full recomputation (no HF cache involved), plus first logits."""
    ids = list(prompt)
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            if first is None:
                first = logits
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], first


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("page_size", "cpu_ops"), [(1, True), (16, True), (16, False)])
def test_greedy_matches_transformers(
    tiny_ckpts, prompts, arch: str, page_size: int, cpu_ops: bool
) -> None:
    """``cpu_ops``: decode attention through hyloop's C++ kernel, or through torch ops."""
    hf = load_hf_model(tiny_ckpts[arch])
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    overrides = [
        "graphs.backend=eager",
        f"model.cpu_ops={str(cpu_ops).lower()}",
        f"kv_pool.page_size={page_size}",
        "kv_pool.num_pages=512",
        "scheduler.prefill_chunk=32",
        "scheduler.prefill_token_budget=64",
    ]
    with LLM(model=tiny_ckpts[arch], overrides=overrides) as llm:
        llm.engine.capture_logits = True
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_invariants()
    for out, (ref_tokens, _), prompt in zip(outs, refs, prompts, strict=True):
        assert out.outputs[0].token_ids == ref_tokens, f"prompt len {len(prompt)}"
        assert out.outputs[0].finish_reason == "length"
    # Last-position logits of the prompt (the first sampled token's logits).
    with LLM(model=tiny_ckpts[arch], overrides=overrides) as llm:
        llm.engine.capture_logits = True
        for prompt, (_, ref_logits) in zip(prompts, refs, strict=True):
            llm.engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            req = llm.engine.request("x")
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            torch.testing.assert_close(req.logits[0], ref_logits, atol=1e-4, rtol=0)
