"""What every decoder-only causal LM here shares: embeddings in, layers, norm, LM head out.

A subclass builds ``self.spec`` (with ``tie_word_embeddings``), ``self.model`` (with
``embed_tokens``, ``layers`` and ``norm``) and ``self.lm_head``, then calls ``tie_weights()``.
"""

from __future__ import annotations

import torch
from torch import nn

from hyloop.graphs.context import StepContext
from hyloop.models.weights import StackedParam


class DecoderLM(nn.Module):
    """``forward(ctx) -> hidden [B, T, H]``; ``compute_logits(hidden [N, H]) -> fp32 [N, V]``."""

    spec: object
    model: nn.Module
    lm_head: nn.Linear
    stacked_params = (
        StackedParam("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        StackedParam("gate_up_proj", ("gate_proj", "up_proj")),
    )

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:  # type: ignore[attr-defined]
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        if self.spec.tie_word_embeddings:  # type: ignore[attr-defined]
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def forward(self, ctx: StepContext) -> torch.Tensor:
        x = self.model.embed_tokens(ctx.input_ids)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()
