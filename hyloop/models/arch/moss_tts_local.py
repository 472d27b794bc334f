"""MOSS-TTS-Local: a Qwen3 backbone over multi-channel rows plus a per-frame depth transformer.

A row ``[C = n_vq + 1]`` is a text id (channel 0) and ``n_vq`` RVQ codes; the backbone (dense
Qwen3, ``llama.py``) reads the sum of its channel embeddings, codes >= ``audio_vocab_size`` (the
pad code too) embedding to zero. ``decode_frame`` turns the backbone's last normed hidden state
into the next frame: the local transformer at position 0 feeds a binary stop head, then code c's
logits are the local output times codebook c's (tied) embedding table, and the sampled code
enters the local transformer at position c + 1.

Checkpoint (``model_type: "moss_tts_local"``, whatever ``architectures`` says): config keys
``language_config`` (or ``qwen3_config``), ``n_vq``, ``audio_vocab_size``, ``gpt2_config``
{``n_head``, ``n_inner``, ``rope_base``, ``layer_norm_epsilon``}, ``local_transformer_layers``,
the special ids; tensors ``model.*`` (or ``transformer.*``), ``audio_embeddings.{i}.weight``
(``audio_pad_code + 1`` rows as released, sglang-omni's ``vocab_size_list``, or
``audio_vocab_size``; ``adapt_weight``), ``local_transformer.*``, ``local_text_lm_head.weight``;
``text_lm_head.*`` and ``audio_lm_heads.*`` are ignored, any other unknown tensor is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyloop.graphs.sampler import sample, window_repetition_penalty
from hyloop.graphs.step_batch import StepBatch
from hyloop.models.arch.llama import DecoderBody, DenseCausalLM, DenseSpec
from hyloop.models.contract import RowLayout, contract_of
from hyloop.models.layers.attention import TorchPath
from hyloop.models.layers.local_transformer import LocalTransformer
from hyloop.models.registry import register

IGNORED_HEADS = ("text_lm_head.", "audio_lm_heads.")
_TORCH = TorchPath()
STOP, CONTINUE = 1, 0
# The v1.5 release's template ids (its processor and sglang-omni's defaults).
PROMPT_ID_DEFAULTS = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "audio_start_token_id": 151669,
    "audio_user_slot_token_id": 151654,
}


@dataclass(frozen=True)
class MossTTSLocalConfig:
    """The fields beyond the backbone's, validated against it."""

    n_vq: int
    audio_vocab_size: int
    audio_pad_code: int
    slot_id: int  # audio_assistant_slot_token_id: channel 0 of a continuing frame
    end_id: int  # audio_end_token_id: channel 0 of a stop frame
    pad_token_id: int | None
    # The prompt template's ids (``hyloop.tts.prompts``; checked against the vocab when a
    # prompt is built, so a rows-only checkpoint need not carry them).
    prompt_ids: dict[str, int]
    local_layers: int
    local_heads: int
    local_inner: int
    rope_base: float
    layer_norm_eps: float
    activation: str

    @classmethod
    def from_hf(cls, hf: dict[str, Any], backbone: DenseSpec) -> MossTTSLocalConfig:
        where = "moss_tts_local config"
        hidden = int(hf.get("hidden_size") or backbone.hidden_size)
        if hidden != backbone.hidden_size:
            raise ValueError(
                f"{where}: hidden_size={hidden}, expected the language_config's "
                f"{backbone.hidden_size}"
            )
        n_vq = int(hf.get("n_vq", 12))
        if n_vq < 1:
            raise ValueError(f"{where}: n_vq={n_vq}, expected >= 1")
        channels = int(hf.get("channels", n_vq + 1))
        if channels != n_vq + 1:
            raise ValueError(f"{where}: channels={channels}, expected n_vq + 1 = {n_vq + 1}")
        audio_vocab = int(hf.get("audio_vocab_size", 1024))
        pad_code = int(hf.get("audio_pad_code", audio_vocab))
        if audio_vocab < 1 or pad_code < audio_vocab:
            raise ValueError(
                f"{where}: audio_pad_code={pad_code}, audio_vocab_size={audio_vocab}; expected "
                "audio_vocab_size >= 1 and audio_pad_code >= audio_vocab_size"
            )
        sizes = hf.get("vocab_size_list")
        expected = [backbone.vocab_size] + [pad_code + 1] * n_vq
        if sizes is not None and [int(v) for v in sizes] != expected:
            raise ValueError(f"{where}: vocab_size_list={sizes}, expected {expected}")
        head_mode = hf.get("local_text_head_mode", "binary")
        if head_mode != "binary":
            raise ValueError(f"{where}: local_text_head_mode={head_mode!r}, expected 'binary'")
        ids = {
            "audio_assistant_slot_token_id": int(hf.get("audio_assistant_slot_token_id", 151656)),
            "audio_end_token_id": int(hf.get("audio_end_token_id", 151670)),
        }
        for key, value in ids.items():
            if not 0 <= value < backbone.vocab_size:
                raise ValueError(
                    f"{where}: {key}={value} outside the text vocab [0, {backbone.vocab_size})"
                )
        gpt2 = dict(hf.get("gpt2_config") or {})
        pad_id = hf.get("pad_token_id")
        prompt_ids = {k: int(hf.get(k, v)) for k, v in PROMPT_ID_DEFAULTS.items()}
        return cls(
            n_vq=n_vq,
            audio_vocab_size=audio_vocab,
            audio_pad_code=pad_code,
            slot_id=ids["audio_assistant_slot_token_id"],
            end_id=ids["audio_end_token_id"],
            pad_token_id=None if pad_id is None else int(pad_id),
            prompt_ids=prompt_ids,
            local_layers=int(hf.get("local_transformer_layers", 1)),
            local_heads=int(gpt2.get("n_head") or 32),
            local_inner=int(gpt2.get("n_inner") or 4 * hidden),
            rope_base=float(gpt2.get("rope_base") or 1_000_000.0),
            layer_norm_eps=float(gpt2.get("layer_norm_epsilon") or 1e-6),
            activation=str(gpt2.get("activation_function") or "silu"),
        )


def language_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The backbone's Qwen3 config (``language_config``, or ``qwen3_config``)."""
    lang = hf.get("language_config") or hf.get("qwen3_config")
    if not isinstance(lang, dict):
        raise ValueError(
            "moss_tts_local config: expected a Qwen3 config object under 'language_config' "
            f"(or 'qwen3_config'), got {type(lang).__name__}"
        )
    return dict(lang, architectures=["Qwen3ForCausalLM"])  # per-head q/k norm, no qkv bias


@dataclass
class FrameSampling:
    """Per-row sampling tensors of one frame step (``[B]`` unless noted). Channel ``ch`` (0 = stop
    head, ``c + 1`` = code ``c``) draws at RNG position ``frame_pos * num_channels + ch``. The
    three flags are static per captured artifact."""

    text_temperature: torch.Tensor  # f32, 0 = greedy (stop head)
    text_top_k: torch.Tensor  # int64, >= 2 disables
    text_top_p: torch.Tensor  # f32, 1.0 disables
    audio_temperature: torch.Tensor  # f32, 0 = greedy (codes)
    audio_top_k: torch.Tensor  # int64, >= audio_vocab_size disables
    audio_top_p: torch.Tensor  # f32
    audio_repetition_penalty: torch.Tensor  # f32, 1.0 = off
    history: torch.Tensor  # [B, W, n_vq] int64 codes of the last W frames, -1 = empty
    seeds: torch.Tensor  # int64, 32-bit values
    frame_pos: torch.Tensor  # int64 frame index of the row being sampled
    audio_top_cap: int  # the code samplers' candidates (``step_kinds.candidate_cap``)
    greedy_only: bool = False  # every row is greedy in both groups
    compute: Any = None  # the step's compute path (local attention, top-k); None: torch ops


@dataclass
class FrameOutput:
    rows: torch.Tensor  # [B, C] int64: [slot_id, codes...] or [end_id, pad, ..., pad]
    stop: torch.Tensor  # [B] bool
    codes: torch.Tensor  # [B, n_vq] int64, sampled for every row (stop rows too)
    # (stop logits [B, 2], code logits [B, n_vq, audio_vocab_size]) as sampled (after the
    # repetition penalty), fp32; only when asked for.
    logits: tuple[torch.Tensor, torch.Tensor] | None = None


@register(
    "MossTTSLocalModel", "MossTTSLocalForConditionalGeneration", model_types=("moss_tts_local",)
)
class MossTTSLocalLM(nn.Module):
    """``forward(batch)`` over rows ``[B, T, C]`` -> normed hidden ``[B, T, H]``;
    ``decode_frame(last [B, H], sampling, tok_hash) -> FrameOutput``."""

    stacked_params = DenseCausalLM.stacked_params

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        self.spec = DenseSpec.from_hf(language_config(hf_config))
        cfg = self.config = MossTTSLocalConfig.from_hf(hf_config, self.spec)
        self.n_vq = cfg.n_vq
        self.num_channels = cfg.n_vq + 1
        self.audio_vocab_size = cfg.audio_vocab_size
        self.pad_code = cfg.audio_pad_code
        self.slot_id = cfg.slot_id
        self.end_id = cfg.end_id
        self.hidden_size = self.spec.hidden_size

        self.model = DecoderBody(self.spec)  # embed_tokens is channel 0's table
        self.audio_embeddings = nn.ModuleList(
            nn.Embedding(cfg.audio_vocab_size, self.hidden_size) for _ in range(cfg.n_vq)
        )
        self.local_transformer = LocalTransformer(
            self.hidden_size,
            cfg.local_heads,
            cfg.local_inner,
            cfg.local_layers,
            self.num_channels,
            cfg.rope_base,
            cfg.layer_norm_eps,
            cfg.activation,
        )
        self.local_text_lm_head = nn.Linear(self.hidden_size, 2, bias=False)
        # Code c's logits read its embedding table (tied): a Linear of its own so the CPU
        # packs its GEMM like every other (``pack_linears``).
        self.audio_heads = nn.ModuleList(
            nn.Linear(self.hidden_size, cfg.audio_vocab_size, bias=False) for _ in range(cfg.n_vq)
        )
        self.tie_weights()
        vocab = (self.spec.vocab_size, *[cfg.audio_pad_code + 1] * cfg.n_vq)
        self.contract = contract_of(
            self,
            vocab_size=max(2, cfg.audio_vocab_size),  # the widest sampled distribution
            max_positions=self.spec.max_positions,
            rope=self.spec.rope,
            rows=RowLayout(vocab, cfg.end_id),
        )

    def tie_weights(self) -> None:
        for head, table in zip(self.audio_heads, self.audio_embeddings, strict=True):
            head.weight = table.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        return {f"audio_heads.{c}.weight": f"audio_embeddings.{c}.weight" for c in range(self.n_vq)}

    def rename_weight(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; None drops the (tied, unused) LM heads."""
        if name.startswith(IGNORED_HEADS):
            return None
        if name.startswith("transformer."):
            return "model." + name.removeprefix("transformer.")
        return name

    def adapt_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A codebook table keeps its first ``audio_vocab_size`` rows. Released checkpoints store
        ``audio_pad_code + 1`` (the pad code's row, which sglang-omni zeroes after loading); a
        row at or past ``audio_vocab_size`` is never read here, since such codes embed to zero
        (``embed_rows``) and no sampler draws them. A table with fewer rows stays as it is, so
        the loader names it as mis-shaped."""
        table = name.startswith("audio_embeddings.") and tensor.dim() == 2
        if table and tensor.shape[0] > self.audio_vocab_size:
            return tensor[: self.audio_vocab_size]
        return tensor

    def embed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [..., C]`` -> the sum of the channels' embeddings ``[..., H]``."""
        x = self.model.embed_tokens(rows[..., 0])
        v = self.audio_vocab_size
        for c, table in enumerate(self.audio_embeddings):
            ids = rows[..., c + 1]
            # NOTE: the pad code (and any id >= audio_vocab_size) is a legal input that embeds
            # to zero, so a text row with pad codes embeds exactly like its text id alone.
            e = table(ids.clamp(0, v - 1))
            x = x + torch.where((ids < v).unsqueeze(-1), e, 0.0)
        return x

    def forward(self, batch: StepBatch) -> torch.Tensor:
        x = self.embed_rows(batch.input_ids)
        for layer in self.model.layers:
            x = layer(x, batch)
        return self.model.norm(x)

    def decode_frame(
        self,
        last: torch.Tensor,
        s: FrameSampling,
        tok_hash: torch.Tensor,
        keep_logits: bool = False,
    ) -> FrameOutput:
        """One frame for every row of ``last [B, H]``, fixed shapes and no host sync; ``tok_hash``
        is ``token_hashes(max_vocab)``, of which each sampler reads its own prefix."""
        b, n_vq, v = last.shape[0], self.n_vq, self.audio_vocab_size
        local = self.local_transformer
        compute = s.compute or _TORCH
        base = s.frame_pos * (n_vq + 1)
        x = last.to(self.audio_embeddings[0].weight.dtype)
        cache = local.new_cache(b, x)
        h = local.step(x, 0, cache, compute)
        stop_logits = self.local_text_lm_head(h).float()
        choice = sample(
            stop_logits,
            s.text_temperature,
            s.text_top_k,
            s.text_top_p,
            s.seeds,
            base,
            tok_hash[:2],
            2,  # both candidates: exact for every row's top-k / top-p
            s.greedy_only,
            compute.topk,
        )
        penalty = s.audio_repetition_penalty.float()[:, None]
        codes: list[torch.Tensor] = []
        code_logits: list[torch.Tensor] = []
        for c in range(n_vq):
            logits = self.audio_heads[c](h).float()
            logits = window_repetition_penalty(logits, s.history[:, :, c], penalty)
            code = sample(
                logits,
                s.audio_temperature,
                s.audio_top_k,
                s.audio_top_p,
                s.seeds,
                base + (c + 1),
                tok_hash[:v],
                s.audio_top_cap,
                s.greedy_only,
                compute.topk,
            )
            codes.append(code)
            if keep_logits:
                code_logits.append(logits)
            if c + 1 < n_vq:
                h = local.step(self.audio_embeddings[c](code), c + 1, cache, compute)
        code_rows = torch.stack(codes, dim=1)
        stop = choice == STOP
        cont = torch.cat([code_rows.new_full((b, 1), self.slot_id), code_rows], dim=1)
        ended = torch.cat(
            [code_rows.new_full((b, 1), self.end_id), code_rows.new_full((b, n_vq), self.pad_code)],
            dim=1,
        )
        rows = torch.where(stop.unsqueeze(1), ended, cont)
        kept = (stop_logits, torch.stack(code_logits, dim=1)) if keep_logits else None
        return FrameOutput(rows, stop, code_rows, kept)
