"""The decoder stack inside the engine (``model.cpu_stack=true``, whatever the CPU): the same
greedy tokens as layer by layer, a compiled step with the stack equal to the eager one, and the
run summary saying where it runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyloop import LLM, SamplingParams
from hyloop.models.cpu import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.ensure_loaded(), reason="no C++ compiler: hyloop's CPU kernels cannot be built"
)

BASE = ["graphs.buckets=[1,4]", "model.max_context=96", "kv_pool.page_size=16"]
PROMPTS = [[5, 9, 13, 17, 21], [7, 7, 7], [30, 31, 32, 33, 34, 35, 36, 37], [90, 3]]


def _tokens(ckpt: Path, *overrides: str) -> list[list[int]]:
    with LLM(model=ckpt, overrides=[*BASE, *overrides]) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        if "model.cpu_stack=true" in overrides:
            assert "decoder stack  every decode step in one call" in llm.summary()
        return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_stack_gives_the_layers_tokens(tiny_ckpts: dict[str, Path], name: str) -> None:
    layers = _tokens(tiny_ckpts[name], "graphs.backend=eager", "model.cpu_stack=false")
    stack = _tokens(tiny_ckpts[name], "graphs.backend=eager", "model.cpu_stack=true")
    assert stack == layers


@pytest.mark.slow
def test_a_compiled_step_with_the_stack_equals_eager(tiny_ckpts: dict[str, Path]) -> None:
    eager = _tokens(tiny_ckpts["llama"], "graphs.backend=eager", "model.cpu_stack=true")
    compiled = _tokens(tiny_ckpts["llama"], "graphs.backend=compile", "model.cpu_stack=true")
    assert compiled == eager
