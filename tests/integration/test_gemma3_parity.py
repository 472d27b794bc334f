"""Greedy parity with HF transformers on a tiny random Gemma 3 with a small sliding window.

Prompts run shorter and longer than the window (8) and than a prefill chunk (16), so the window
mask is exercised in chunked prefill and in decode, eager and compiled, page_size 1 and 16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyloop import LLM, SamplingParams

WINDOW = 8
TINY_GEMMA3: dict[str, Any] = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    rope_theta=100000.0,
    rope_local_base_freq=5000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
PROMPT_LENS = [1, 5, 9, 17, 40]
NEW_TOKENS = 24


def build_gemma3_checkpoint(path: Path, config: dict[str, Any] = TINY_GEMMA3) -> Path:
    """A random Gemma 3 whose norm weights are non-zero, so ``1 + w`` is checked too."""
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.Gemma3TextConfig(
        **{k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    )
    model = transformers.Gemma3ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full recomputation, plus the first token's logits."""
    ids, first = list(prompt), None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], first


@pytest.fixture(scope="module")
def gemma3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def refs(gemma3_ckpt: Path, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3_ckpt, dtype=torch.float32)
    return [hf_greedy(hf.eval(), p, NEW_TOKENS) for p in prompts]


def test_the_window_changes_the_reference(
    gemma3_ckpt: Path, prompts: list[list[int]], refs: list[tuple[list[int], torch.Tensor]]
) -> None:
    """Guards the parity tests below: with a window as long as the context, some greedy
    continuation differs, so matching the reference needs the window mask."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(gemma3_ckpt)
    cfg.sliding_window = 4096
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3_ckpt, config=cfg).eval()
    unwindowed = [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    assert unwindowed != [r[0] for r in refs]


@pytest.mark.parametrize(
    ("backend", "page_size"), [("eager", 1), ("eager", 16), ("compile", 1), ("compile", 16)]
)
def test_greedy_matches_transformers(
    gemma3_ckpt: Path,
    prompts: list[list[int]],
    refs: list[tuple[list[int], torch.Tensor]],
    backend: str,
    page_size: int,
) -> None:
    overrides = [
        f"graphs.backend={backend}",
        "graphs.buckets=[4]",
        f"kv_pool.page_size={page_size}",
        "kv_pool.num_pages=512",
        "scheduler.prefill_chunk=16",
        "scheduler.prefill_token_budget=32",
    ]
    with LLM(model=gemma3_ckpt, overrides=overrides) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_invariants()
        for out, (ref_tokens, _), prompt in zip(outs, refs, prompts, strict=True):
            assert out.outputs[0].token_ids == ref_tokens, f"prompt len {len(prompt)}"
        if backend != "eager":
            return
        llm.engine.capture_logits = True
        for i, (prompt, (_, ref_logits)) in enumerate(zip(prompts, refs, strict=True)):
            llm.engine.add_request(f"l{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            req = llm.engine.request(f"l{i}")
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            torch.testing.assert_close(req.logits[0], ref_logits, atol=1e-4, rtol=0)
