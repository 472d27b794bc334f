"""Weight-only int4 / int8 Linears and ``model.weights``: GGUF blocks decoded against gguf-py's own
``dequantize``, the kernels against a dense float matmul over the same dequantized weights, and
tiny GGUF files (written here with ``gguf.GGUFWriter``, quantized with ``gguf.quants.quantize``)
loaded in every mode, eagerly and compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_gguf_loader import _tiny_vocab, _to_gguf_tensors, _write_gguf

from hyloop import LLM, SamplingParams
from hyloop.framework.config import ConfigError, load_config
from hyloop.models.loader import load_model
from hyloop.models.loaders.gguf_blocks import GGUFBlocks, unpermute_rope_rows
from hyloop.models.quant import (
    Int4Linear,
    Int8Linear,
    Int8Rows,
    int4_from_dense,
    int8_from_dense,
    quantize_linears,
)

CPU = torch.device("cpu")


def _k_quant_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf-py cannot quantize to them): random codes and sub-block
    scales, with finite fp16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, (data.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        data[:, :4] = scales  # d, dmin
    else:
        data[:, -2:] = scales[:, :2]  # Q6_K: d is last
    return data.reshape(rows, -1)


def _blocks(qtype: Q, rows: int = 64, cols: int = 256, heads: int = 0) -> GGUFBlocks:
    if qtype in (Q.Q4_K, Q.Q6_K):
        data = _k_quant_blocks(qtype, rows, cols)
    else:
        x = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        data = quantize(x, qtype)
    return GGUFBlocks("blk.0.attn_q.weight", qtype, data, (rows, cols), heads)


# ---------------------------------------------------------------- GGUF blocks -> int4 groups


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_4bit_blocks_decode_to_the_files_own_values(qtype: Q) -> None:
    src = _blocks(qtype)
    groups = src.int4_groups()
    assert groups.codes.dtype == torch.uint8 and int(groups.codes.max()) <= 15
    assert groups.group == 32
    reference = torch.from_numpy(dequantize(src.data, qtype).reshape(src.shape))
    torch.testing.assert_close(groups.dequantize(), reference, rtol=1e-6, atol=1e-7)


def test_int4_groups_follow_the_unpermuted_rows() -> None:
    src = _blocks(Q.Q4_1, rows=64, heads=4)
    dense = torch.from_numpy(dequantize(src.data, Q.Q4_1).reshape(src.shape))
    torch.testing.assert_close(
        src.int4_groups().dequantize(), unpermute_rope_rows(dense, 4), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q6_K])
def test_other_blocks_are_not_int4(qtype: Q) -> None:
    src = _blocks(qtype)
    assert not src.is_int4
    with pytest.raises(ValueError, match=qtype.name):
        src.int4_groups()


# ---------------------------------------------------------------- formats and kernels


def test_round_to_nearest_stays_within_half_a_step() -> None:
    w = torch.randn(96, 128) * 0.05
    g4 = int4_from_dense(w)
    step = g4.scale.repeat_interleave(g4.group, dim=1)
    assert bool(((g4.dequantize() - w).abs() <= step * 0.5001).all())
    r8 = int8_from_dense(w)
    assert bool(((r8.dequantize() - w).abs() <= r8.scale[:, None] * 0.5001).all())


@pytest.mark.parametrize("fmt", ["int4", "int4-gguf", "int8"])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_packed_matmul_matches_the_dequantized_weight(fmt: str, rows: int) -> None:
    torch.manual_seed(0)
    w, bias = torch.randn(128, 256) * 0.05, torch.randn(128) * 0.1
    layer: torch.nn.Module
    if fmt == "int8":
        r8 = int8_from_dense(w)
        layer, dense = Int8Linear(r8, bias), r8.dequantize()
    else:
        g4 = _blocks(Q.Q4_K, 128, 256).int4_groups() if fmt == "int4-gguf" else int4_from_dense(w)
        layer, dense = Int4Linear(g4, bias), g4.dequantize()
    x = torch.randn(2, rows, 256)
    got = layer(x)
    assert got.shape == (2, rows, 128) and got.dtype == torch.float32
    # Activations are rounded to 16-bit codes per group of 32: tolerances of that rounding.
    ref = F.linear(x, dense, bias)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * float(ref.abs().max()))


def test_kernel_shape_rules_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Linear(int4_from_dense(torch.randn(40, 64)))
    with pytest.raises(ValueError, match="group"):
        int4_from_dense(torch.randn(32, 48))


# ---------------------------------------------------------------- tiny GGUF files, every mode

# Big enough that every Linear passes the quantization threshold (64k weights), still tiny.
HIDDEN = 256
TYPES = {  # llama.cpp tensor stem -> the block type written
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q8_0,
    "token_embd": Q.Q8_0,
}


def _tiny_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(_tiny_vocab()[0]),  # 266: not a multiple of 16 (no int4 LM head)
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = _tiny_model()
    dense = _to_gguf_tensors(model, "llama")
    dense.pop("output.weight", None)  # tied: llama.cpp writes no output tensor
    quantized: dict[str, Any] = {}
    for name, array in dense.items():
        qtype = TYPES.get(name.split(".")[-2])
        quantized[name] = array if qtype is None else (quantize(array, qtype), qtype)
    root = tmp_path_factory.mktemp("quant_gguf")
    return {
        "dense": _write_gguf(root / "f32.gguf", "llama", model.config, dense),
        "quantized": _write_gguf(root / "q.gguf", "llama", model.config, quantized),
    }


@pytest.mark.parametrize(
    ("mode", "counts"),
    [
        ("dequantize", {}),
        # per layer q/k/v (4-bit), o, gate/up -> int4; down (Q8_0) -> int8; tied head (Q8_0) int8
        ("auto", {"int4": 6, "int8": 3}),
        ("int8", {"int8": 9}),
        ("int4", {"int4": 8, "dense": 1}),  # the 266-row head breaks the kernel's multiple of 16
    ],
)
def test_each_mode_picks_its_formats(tiny_files: dict[str, Path], mode: str, counts: dict) -> None:
    loaded = load_model(tiny_files["quantized"], torch.float32, CPU, mode)
    assert loaded.quantized == counts
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert ("Int4Linear" in kinds) == ("int4" in counts)
    assert ("Int8Linear" in kinds) == ("int8" in counts)


def test_auto_on_dense_tensors_keeps_them_dense(tiny_files: dict[str, Path]) -> None:
    assert load_model(tiny_files["dense"], torch.float32, CPU, "auto").quantized == {"dense": 9}
    assert load_model(tiny_files["dense"], torch.float32, CPU, "int8").quantized == {"int8": 9}


def test_bad_weights_modes_are_named() -> None:
    with pytest.raises(ConfigError, match=r"model\.weights"):
        load_config(overrides=["model.weights=int3"])
    model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    with pytest.raises(ValueError, match=r"model\.weights='int3'"):
        quantize_linears(model, "int3", {}, CPU)
    with pytest.raises(ValueError, match=r"model\.weights='int4'.*dequantize"):
        quantize_linears(model, "int4", {}, torch.device("meta"))
    assert quantize_linears(model, "auto", {}, torch.device("meta")) == {}  # auto: stays dense


def test_auto_int4_layers_compute_with_the_files_values(tiny_files: dict[str, Path]) -> None:
    """Each int4 layer of ``auto`` multiplies by exactly the weight ``dequantize`` holds (the
    file's codes), up to the 16-bit activations' rounding (about 1e-4 of the output)."""
    auto = load_model(tiny_files["quantized"], torch.float32, CPU, "auto").model
    dense = dict(
        load_model(tiny_files["quantized"], torch.float32, CPU, "dequantize").model.named_modules()
    )
    checked = 0
    for name, layer in auto.named_modules():
        if isinstance(layer, Int4Linear):
            x = torch.randn(3, layer.in_features)
            ref = F.linear(x, dense[name].weight).detach()
            torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-3 * float(ref.abs().max()))
            checked += 1
    assert checked == 6


def _run(path: Path, weights: str, backend: str, prompts: list[list[int]]) -> list[Any]:
    overrides = [
        f"model.weights={weights}",
        f"graphs.backend={backend}",
        "graphs.buckets=[2]",
        "model.max_context=64",
        "kv_pool.page_size=16",
        "kv_pool.num_pages=16",
        "scheduler.max_running_requests=2",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    with LLM(model=path, overrides=overrides) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if backend == "compile":  # the captured artifact ran every decode step
            stats = llm.stats()
            assert stats["graph_replays"] > 0 and stats["eager_fallbacks"] == 0, stats
        return outs


def _nll(out: Any, prompt: list[int]) -> list[float]:
    return [-lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]


_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, 266, (48,), generator=_g).tolist(), [1, 40, 75, 75, 78, 200, 7, 3]]


@pytest.mark.parametrize("weights", ["auto", "int8", "int4"])
def test_prompt_nll_stays_near_the_dequantized_model(
    tiny_files: dict[str, Path], weights: str
) -> None:
    """The quality measure of ``bench/quantized.py`` in small: a prompt's mean negative
    log-likelihood under each mode within 2% of the dense oracle's."""
    path = tiny_files["quantized"]
    ref = _nll(_run(path, "dequantize", "eager", PROMPTS[:1])[0], PROMPTS[0])
    got = _nll(_run(path, weights, "eager", PROMPTS[:1])[0], PROMPTS[0])
    assert abs(sum(got) - sum(ref)) / sum(ref) < 0.02
    assert sum(got) != sum(ref)  # the quantized layers ran


@pytest.mark.slow
def test_compiled_step_with_quantized_weights_equals_eager(tiny_files: dict[str, Path]) -> None:
    """Eager is the oracle: the compiled step traces the same int4 / int8 kernels."""
    path = tiny_files["quantized"]
    eager = [o.outputs[0].token_ids for o in _run(path, "auto", "eager", PROMPTS)]
    compiled = [o.outputs[0].token_ids for o in _run(path, "auto", "compile", PROMPTS)]
    assert compiled == eager


def test_auto_keeps_q8_0_blocks_as_the_file_holds_them(tiny_files: dict[str, Path]) -> None:
    """Q8_0 (ffn_down, the tied head) stays the file's int8 codes and per-32 scales: the layer's
    weight is exactly the dequantized file's, no per-row requantization."""
    auto = load_model(tiny_files["quantized"], torch.float32, CPU, "auto").model
    dense = dict(
        load_model(tiny_files["quantized"], torch.float32, CPU, "dequantize").model.named_modules()
    )
    checked = 0
    for name, layer in auto.named_modules():
        if isinstance(layer, Int8Linear) and layer.codes is not None:
            held = Int8Rows(layer.codes, layer.scale).dequantize()
            assert torch.equal(held, dense[name].weight.detach()), name
            checked += 1
    assert checked == 3  # two down projections and the head


KERNELS_OFF_CHILD = r"""
import json, sys
from hyloop import LLM, SamplingParams
args = json.loads(sys.argv[1])
with LLM(model=args["path"], overrides=args["overrides"]) as llm:
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate(args["prompts"], params, use_tqdm=False)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "logprobs": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
                                   for o in outs],
                      "numerics": llm.stats()["numerics"]}))
"""


def _greedy_run(path: Path, overrides: list[str], kernels: bool) -> dict[str, Any]:
    env = {**os.environ, "HYLOOP_CPU_OPS": "1" if kernels else "0"}
    args = json.dumps({"path": str(path), "overrides": overrides, "prompts": PROMPTS})
    done = subprocess.run(
        [sys.executable, "-c", KERNELS_OFF_CHILD, args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["model.weights=auto"],
        ["model.weights=dequantize", "dtype=bfloat16"],
        ["model.weights=auto", "graphs.backend=compile", "graphs.buckets=[2]"],
    ],
    ids=["auto", "bf16", "auto-compile"],
)
def test_without_the_kernels_a_run_computes_the_same_bits(
    tiny_files: dict[str, Path], overrides: list[str]
) -> None:
    """``HYLOOP_CPU_OPS=0`` (a machine without a compiler): the torch definitions of every
    kernel give the same greedy tokens and the same logprobs, to the bit, 32 tokens a row."""
    path = tiny_files["quantized"]
    common = [*overrides, "model.max_context=128", "scheduler.max_running_requests=2"]
    with_kernels = _greedy_run(path, common, kernels=True)
    without = _greedy_run(path, common, kernels=False)
    assert "C++ kernels" in with_kernels["numerics"]
    assert "torch reference" in without["numerics"]
    assert all(len(t) == 32 for t in with_kernels["tokens"])
    assert without["tokens"] == with_kernels["tokens"]
    assert without["logprobs"] == with_kernels["logprobs"]
