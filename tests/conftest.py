"""Shared fixtures: tiny random checkpoints in HF layout, built with transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from row_lm import RowCausalLM  # noqa: F401  (registers HyloopRowLM)

from hyloop.graphs.step_batch import StepBatch, StepPools
from hyloop.models.cpu import cpu_ops
from hyloop.models.layers.attention import TorchPath


def pytest_configure(config: pytest.Config) -> None:
    # Build (once per machine) and load hyloop's CPU kernels before any engine exists, so
    # every engine of the session takes the same path (``model.cpu_ops=auto`` would otherwise
    # leave a fresh machine's whole session on torch ops while a background build runs).
    cpu_ops.ensure_loaded(build=True)


def make_batch(
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    kv_len: int,
    kv: Any = None,
    recurrent: Any = None,
    state_slots: torch.Tensor | None = None,
    track_slots: torch.Tensor | None = None,
    is_decode: bool = False,
    compute: Any = None,
) -> StepBatch:
    """A ``StepBatch`` for driving a model by hand (torch compute path unless given)."""
    zeros = torch.zeros(input_ids.shape[0], dtype=torch.int64)
    return StepBatch(
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_rows=req_rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        state_slots=zeros if state_slots is None else state_slots,
        track_slots=zeros if track_slots is None else track_slots,
        out_pos=zeros,
        keeps=torch.ones_like(zeros),
        pools=StepPools(req_to_token, kv, recurrent, compute=compute or TorchPath()),
        kv_len=kv_len,
        is_decode=is_decode,
    )


# bf16 in a oneDNN-packed Linear, where this CPU can pack it (AVX-512 or AVX-NE-CONVERT).
BF16_PACKED = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        reason="this CPU has no oneDNN bf16 packing (needs AVX-512 or AVX-NE-CONVERT)",
    ),
    id="bfloat16",
)

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
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (the built-in default), or a skip saying why not."""
    from hyloop.recipes.offline import default_checkpoint

    try:
        return default_checkpoint()
    except FileNotFoundError as e:
        pytest.skip(str(e))


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


def tiny_moss_local_config(n_vq: int, audio_vocab: int, local_layers: int) -> dict[str, Any]:
    """A MOSS-TTS-Local config.json: Qwen3 backbone, ``n_vq`` codebooks, special ids < 256."""
    return dict(
        architectures=["MossTTSLocalModel"],
        model_type="moss_tts_local",
        language_config=dict(TINY_DENSE["qwen3"]),
        hidden_size=64,
        n_vq=n_vq,
        channels=n_vq + 1,
        audio_vocab_size=audio_vocab,
        audio_pad_code=audio_vocab,
        vocab_size_list=[256] + [audio_vocab + 1] * n_vq,
        local_transformer_layers=local_layers,
        gpt2_config=dict(n_head=4, n_inner=128, rope_base=1_000_000.0, layer_norm_epsilon=1e-6),
        audio_assistant_slot_token_id=250,
        audio_end_token_id=251,
        pad_token_id=252,
        im_start_token_id=245,
        im_end_token_id=246,
        audio_start_token_id=247,
        audio_user_slot_token_id=248,
        initializer_range=0.1,
    )


def moss_local_tensors(
    config: dict[str, Any], seed: int = 0, layout: str = "released"
) -> dict[str, torch.Tensor]:
    """Random weights: the Qwen3 backbone under ``transformer.`` (a transformers model), the
    codebook tables, the local transformer, the binary stop head, and the unused
    ``text_lm_head`` / ``audio_lm_heads`` tensors. ``layout="released"``: each table has
    ``audio_pad_code + 1`` rows (sglang-omni's ``vocab_size_list``), the pad row random, not
    zero, as a checkpoint may hold it; ``"compact"``: ``audio_vocab_size`` rows."""
    import transformers

    torch.manual_seed(seed)
    lang = config["language_config"]
    qwen_cfg = transformers.Qwen3Config(
        **{k: v for k, v in lang.items() if k not in ("model_type", "architectures")}
    )
    qwen = transformers.Qwen3ForCausalLM(qwen_cfg).float().eval()
    out = {
        "transformer." + k.removeprefix("model."): v
        for k, v in qwen.state_dict().items()
        if k.startswith("model.")
    }
    out["text_lm_head.weight"] = qwen.lm_head.weight.detach().clone()
    hidden, std = config["hidden_size"], 0.1
    inner = config["gpt2_config"]["n_inner"]
    vocab = config["audio_vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * std

    rows = {"released": config["audio_pad_code"] + 1, "compact": vocab}[layout]
    for i in range(config["n_vq"]):
        out[f"audio_embeddings.{i}.weight"] = normal(rows, hidden)
        out[f"audio_lm_heads.{i}.weight"] = normal(vocab, hidden)
    for i in range(config["local_transformer_layers"]):
        p = f"local_transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + ln + ".weight"] = 1.0 + normal(hidden)
            out[p + ln + ".bias"] = normal(hidden)
        shapes = {
            "attn.c_attn": (3 * hidden, hidden),
            "attn.c_proj": (hidden, hidden),
            "mlp.fc_in": (inner, hidden),
            "mlp.fc_out": (hidden, inner),
        }
        for name, (rows, cols) in shapes.items():
            out[p + name + ".weight"] = normal(rows, cols)
            out[p + name + ".bias"] = normal(rows)
    out["local_transformer.ln_f.weight"] = 1.0 + normal(hidden)
    out["local_transformer.ln_f.bias"] = normal(hidden)
    out["local_text_lm_head.weight"] = normal(2, hidden)
    return {k: v.detach().contiguous() for k, v in out.items()}


# The tiny TTS tokenizer's special tokens, at the ids ``tiny_moss_local_config`` names.
TTS_SPECIAL_TOKENS = {
    245: "<|im_start|>",
    246: "<|im_end|>",
    247: "<|audio_start|>",
    248: "<|audio_user_slot|>",
    250: "<|audio_assistant_slot|>",
    251: "<|audio_end|>",
    252: "<|endoftext|>",
}
TTS_CORPUS = [
    "user\n<user_inst>\n- Reference(s):\nNone\n- Instruction:\nNone\n- Tokens:\nNone",
    "\n- Quality:\nNone\n- Sound Event:\nNone\n- Ambient Sound:\nNone\n- Language:\nen",
    "\n- Text:\n\n</user_inst>\nassistant\n",
    "Hello there, how are you today? The quick brown fox jumps over the lazy dog.",
    "A voice reads this sentence slowly and clearly, with calm warmth. 0123456789",
]


def tiny_tts_tokenizer_json(path: Path, vocab_size: int = 256) -> Path:
    """A small BPE ``tokenizer.json`` (trained on the template and a few sentences) whose
    special tokens sit at ``TTS_SPECIAL_TOKENS``' ids, as the released tokenizer's do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    first = min(TTS_SPECIAL_TOKENS)
    tok.train_from_iterator(
        TTS_CORPUS, trainers.BpeTrainer(vocab_size=first, special_tokens=["<unk>"])
    )
    tok.add_tokens([f"<filler_{i}>" for i in range(tok.get_vocab_size(), first)])
    for i in range(first, vocab_size):
        tok.add_special_tokens(
            [AddedToken(TTS_SPECIAL_TOKENS.get(i, f"<|extra_{i}|>"), special=True)]
        )
    for i, name in TTS_SPECIAL_TOKENS.items():
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(path))
    return path


def write_moss_local_checkpoint(
    path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], tokenizer: bool = True
) -> Path:
    """A checkpoint directory: config, weights and (``tokenizer``) a tiny ``tokenizer.json``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    if tokenizer:
        lang = config.get("language_config") or config["qwen3_config"]
        tiny_tts_tokenizer_json(path / "tokenizer.json", lang["vocab_size"])
    return path


TINY_MOSS_LOCAL: dict[str, tuple[int, int, int]] = {  # name -> (n_vq, audio vocab, local layers)
    "nvq3_v16_l1": (3, 16, 1),
    "nvq4_v32_l2": (4, 32, 2),
}


@pytest.fixture(scope="session")
def moss_local_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moss_local")
    ckpts = {}
    for seed, (name, shape) in enumerate(TINY_MOSS_LOCAL.items()):
        cfg = tiny_moss_local_config(*shape)
        ckpts[name] = write_moss_local_checkpoint(root / name, cfg, moss_local_tensors(cfg, seed))
    return ckpts
