"""Shared fixtures: tiny random checkpoints in HF layout, built with transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

# Tiny test models gain nothing from intra-op threads and lose a lot to their contention.
torch.set_num_threads(1)

TINY_DENSE: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        initializer_range=0.1,
        tie_word_embeddings=False,
        use_sliding_window=False,
        eos_token_id=2,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
}


HYBRID_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
    eos_token_id=2,
    full_attention_interval=2,
)
TINY_HYBRID: dict[str, dict[str, Any]] = {
    # Key heads != value heads (grouped value heads), sparse MoE with a shared expert.
    "qwen3_next": dict(
        HYBRID_COMMON,
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[3],
    ),
    # Key heads == value heads, dense MLP, tied embeddings.
    "qwen3_5": dict(
        HYBRID_COMMON,
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        linear_num_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def build_hf_checkpoint(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """Save a random transformers model of ``config`` as ``config.json`` + safetensors."""
    import transformers

    torch.manual_seed(seed)
    cfg_cls = transformers.AutoConfig.for_model(config["model_type"])
    hf_cfg = type(cfg_cls).from_dict({k: v for k, v in config.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_model(path: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: build_hf_checkpoint(root / name, cfg) for name, cfg in TINY_DENSE.items()}


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="session")
def hybrid_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid_ckpts")
    return {
        name: build_hf_checkpoint(root / name, cfg, seed=3) for name, cfg in TINY_HYBRID.items()
    }


TINY_ROW: dict[str, Any] = dict(
    architectures=["HyloopRowLM"],
    model_type="hyloop_row",
    channel_vocab_sizes=[64, 32, 32, 32],
    end_id=2,
    eos_token_id=2,
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def build_row_checkpoint(path: Path, config: dict[str, Any] = TINY_ROW, seed: int = 0) -> Path:
    """A random multi-channel row model in hyloop's own layout (no HF class exists for it)."""
    from safetensors.torch import save_file

    from hyloop.models.arch.row_lm import RowCausalLM

    torch.manual_seed(seed)
    model = RowCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors"
    )
    return path


@pytest.fixture(scope="session")
def row_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_row_checkpoint(tmp_path_factory.mktemp("row_ckpt") / "row")
