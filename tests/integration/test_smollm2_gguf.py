"""SmolLM2-135M-Instruct from its GGUF file: greedy text, and greedy ids equal transformers'.

Both sides read the same GGUF file (transformers dequantises it itself, offline) and start from
the same prompt token ids, so any difference is in hyloop's loader, model or decode loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hyloop import LLM, RequestOutput, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> Iterator[LLM]:
    overrides = [
        "graphs.backend=eager",
        "model.max_context=256",
        "kv_pool.page_size=16",
        "kv_pool.num_pages=32",
        "model.weights=dequantize",  # transformers, the oracle, dequantizes the file
    ]
    with LLM(model=gguf_path, overrides=overrides) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[int]:
    assert llm.tokenizer is not None, "the GGUF file carries a tokenizer"
    return list(llm.tokenizer.encode(PROMPT))


@pytest.fixture(scope="module")
def greedy(llm: LLM, prompt_ids: list[int]) -> RequestOutput:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm.generate([prompt_ids], params, use_tqdm=False)[0]


def test_greedy_continuation_starts_with_paris(greedy: RequestOutput) -> None:
    sample = greedy.outputs[0]
    assert sample.text  # decoded: "" when there is no tokenizer
    assert sample.text.startswith(" Paris"), repr(sample.text)
    assert len(sample.token_ids) == NEW_TOKENS


def test_greedy_ids_equal_transformers_on_the_same_file(
    gguf_path: Path,
    prompt_ids: list[int],
    greedy: RequestOutput,
) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=hf.config.eos_token_id,
        )
    assert greedy.outputs[0].token_ids == out[0, len(prompt_ids) :].tolist()
