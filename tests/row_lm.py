"""A test-only multi-channel row model: each token is a row ``[C]`` (text id + codebook ids).

The backbone is hyloop's dense decoder over the sum of per-channel embeddings; ``C`` parallel
heads predict the next row. Channel 0 is the text channel; a row whose text id is ``end_id``
ends the sequence. It serves as a frame model (``decode_frame``): the engine runs it through
the frame step kind like MOSS-TTS-Local, channel 0 sampled with a frame's text group and the
codes with its audio group, so the generic row path (row keys, prompt rows, the UHRC over rows,
captured steps, lookahead) is tested on a model with no TTS specifics.

Config (``config.json``): the Llama fields plus ``architectures: ["HyloopRowLM"]``,
``channel_vocab_sizes: [V0, V1, ...]`` (one per channel; ``vocab_size`` = V0) and ``end_id``.
Importing this module registers the architecture.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyloop.graphs.sampler import sample
from hyloop.graphs.step_batch import StepBatch
from hyloop.models.arch.llama import DecoderBody, DenseCausalLM, DenseSpec
from hyloop.models.arch.moss_tts_local import FrameOutput, FrameSampling
from hyloop.models.contract import RowLayout, contract_of
from hyloop.models.registry import register


class RowBody(DecoderBody):
    def __init__(self, spec: DenseSpec, channel_vocab_sizes: list[int]) -> None:
        super().__init__(spec)
        del self.embed_tokens
        self.embed_tokens = nn.ModuleList(
            nn.Embedding(v, spec.hidden_size) for v in channel_vocab_sizes
        )


@register("HyloopRowLM")
class RowCausalLM(nn.Module):
    """``forward(batch)`` over rows ``[B, T, C]`` -> hidden; ``compute_logits -> [N, C, Vmax]``."""

    stacked_params = DenseCausalLM.stacked_params

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        vocab = [int(v) for v in hf_config["channel_vocab_sizes"]]
        if not vocab or any(v < 1 for v in vocab):
            raise ValueError(f"channel_vocab_sizes: {vocab}, expected positive sizes")
        cfg = dict(hf_config, vocab_size=vocab[0], tie_word_embeddings=False)
        self.spec = DenseSpec.from_hf(cfg)
        self.channel_vocab_sizes = vocab
        self.num_channels = len(vocab)
        self.n_vq = len(vocab) - 1
        self.end_id = int(hf_config["end_id"])
        self.slot_id = (self.end_id + 1) % vocab[0]  # channel 0 of a row that ignores the stop
        self.model = RowBody(self.spec, vocab)
        self.lm_heads = nn.ModuleList(
            nn.Linear(self.spec.hidden_size, v, bias=False) for v in vocab
        )
        self.max_vocab = max(vocab)
        pad = torch.zeros(self.num_channels, self.max_vocab, dtype=torch.bool)
        for c, v in enumerate(vocab):
            pad[c, v:] = True
        self.register_buffer("vocab_pad", pad, persistent=False)
        self.contract = contract_of(
            self,
            vocab_size=self.max_vocab,
            max_positions=self.spec.max_positions,
            rope=self.spec.rope,
            rows=RowLayout(tuple(vocab), self.end_id),
        )

    def reset_buffers(self) -> None:
        if self.vocab_pad.is_meta:
            return
        self.vocab_pad.zero_()
        for c, v in enumerate(self.channel_vocab_sizes):
            self.vocab_pad[c, v:] = True

    def forward(self, batch: StepBatch) -> torch.Tensor:
        rows = batch.input_ids  # [B, T, C]
        x = self.model.embed_tokens[0](rows[..., 0])
        for c in range(1, self.num_channels):
            x = x + self.model.embed_tokens[c](rows[..., c])
        for layer in self.model.layers:
            x = layer(x, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(hidden)
        logits = hidden.new_full((h.shape[0], self.num_channels, self.max_vocab), 0.0).float()
        for c, head in enumerate(self.lm_heads):
            v = self.channel_vocab_sizes[c]
            logits[:, c, :v] = head(h).float()
        return logits.masked_fill(self.vocab_pad, -torch.inf)

    def decode_frame(
        self,
        last: torch.Tensor,
        s: FrameSampling,
        tok_hash: torch.Tensor,
        keep_logits: bool = False,
    ) -> FrameOutput:
        """Every channel sampled from its head: channel 0 with the text group, the codes with
        the audio group (RNG position ``frame_pos * C + channel``)."""
        logits = self.compute_logits(last)
        base = s.frame_pos * self.num_channels
        picks = []
        for c in range(self.num_channels):
            text = c == 0
            picks.append(
                sample(
                    logits[:, c],
                    s.text_temperature if text else s.audio_temperature,
                    s.text_top_k if text else s.audio_top_k,
                    s.text_top_p if text else s.audio_top_p,
                    s.seeds,
                    base + c,
                    tok_hash,
                    self.max_vocab if text else s.audio_top_cap,
                    s.greedy_only,
                )
            )
        rows = torch.stack(picks, dim=1)
        stop = rows[:, 0] == self.end_id
        return FrameOutput(
            rows, stop, rows[:, 1:], (logits[:, 0], logits[:, 1:]) if keep_logits else None
        )
