"""A multi-channel row model: each token is a row ``[C]`` (text id + codebook ids).

The backbone is the dense decoder of ``llama.py`` over the sum of per-channel embeddings; ``C``
parallel heads predict the next row. Channel 0 is the text channel; a row whose text id is
``end_id`` ends the sequence. Radix keys: one op (``graphs.ops.row_keys``) keys prompt rows on
the host and generated rows inside the step, so the UHRC serves rows like tokens.

Config (``config.json``): the Llama fields plus ``architectures: ["HyloopRowLM"]``,
``channel_vocab_sizes: [V0, V1, ...]`` (one per channel; ``vocab_size`` = V0) and ``end_id``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyloop.graphs.context import StepContext
from hyloop.models.arch.llama import DecoderBody, DenseCausalLM, DenseSpec
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
    """``forward(ctx)`` over rows ``[B, T, C]``; ``compute_logits -> [N, C, Vmax]`` fp32."""

    stacked_params = DenseCausalLM.stacked_params
    is_row_model = True

    def __init__(self, hf_config: dict[str, Any]) -> None:
        super().__init__()
        vocab = [int(v) for v in hf_config["channel_vocab_sizes"]]
        if not vocab or any(v < 1 for v in vocab):
            raise ValueError(f"channel_vocab_sizes: {vocab}, expected positive sizes")
        cfg = dict(hf_config, vocab_size=vocab[0], tie_word_embeddings=False)
        self.spec = DenseSpec.from_hf(cfg)
        self.channel_vocab_sizes = vocab
        self.num_channels = len(vocab)
        self.end_id = int(hf_config["end_id"])
        self.model = RowBody(self.spec, vocab)
        self.lm_heads = nn.ModuleList(
            nn.Linear(self.spec.hidden_size, v, bias=False) for v in vocab
        )
        self.num_kv_layers = self.spec.num_layers
        self.kv_heads = self.spec.num_kv_heads
        self.head_dim = self.spec.head_dim
        self.max_vocab = max(vocab)
        pad = torch.zeros(self.num_channels, self.max_vocab, dtype=torch.bool)
        for c, v in enumerate(vocab):
            pad[c, v:] = True
        self.register_buffer("vocab_pad", pad, persistent=False)

    def reset_buffers(self) -> None:
        if self.vocab_pad.is_meta:
            return
        self.vocab_pad.zero_()
        for c, v in enumerate(self.channel_vocab_sizes):
            self.vocab_pad[c, v:] = True

    def forward(self, ctx: StepContext) -> torch.Tensor:
        rows = ctx.input_ids  # [B, T, C]
        x = self.model.embed_tokens[0](rows[..., 0])
        for c in range(1, self.num_channels):
            x = x + self.model.embed_tokens[c](rows[..., c])
        for layer in self.model.layers:
            x = layer(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(hidden)
        logits = hidden.new_full((h.shape[0], self.num_channels, self.max_vocab), 0.0).float()
        for c, head in enumerate(self.lm_heads):
            v = self.channel_vocab_sizes[c]
            logits[:, c, :v] = head(h).float()
        return logits.masked_fill(self.vocab_pad, -torch.inf)
