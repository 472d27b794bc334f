"""What every decoder-only causal LM here shares: embeddings in, layers, norm, LM head out.

A subclass builds ``self.spec`` (with ``tie_word_embeddings``), ``self.model`` (with
``embed_tokens``, ``layers`` and ``norm``) and ``self.lm_head``, calls ``tie_weights()`` and
sets ``self.contract`` (``models.contract.contract_of``).
"""

from __future__ import annotations

import torch
from torch import nn

from hyloop.graphs.step_batch import StepBatch
from hyloop.models.blend import blend_forward
from hyloop.models.contract import ModelContract
from hyloop.models.weights import StackedParam


class DecoderLM(nn.Module):
    """``forward(batch) -> hidden [B, T, H]``; ``compute_logits(hidden [N, H]) -> fp32 [N, V]``."""

    spec: object
    contract: ModelContract
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

    def forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.blend is not None:  # a prefill over reused KV (``contract.selective_recompute``)
            return blend_forward(self.model, batch)
        x = self.model.embed_tokens(batch.input_ids)
        # A decode or verify step: every layer in one call where the compute path has a
        # decoder stack (``models.cpu.DecoderStack``). Prefill chunks never (one-token ones
        # included): a prompt's tokens always run the layers, so how a prefill is chunked
        # changes no row.
        decode = batch.is_decode or batch.verify
        stack = getattr(batch.pools.compute, "stack", None) if decode else None
        if stack is not None and stack.runs(x.shape[0]):
            return stack(x, batch)
        for layer in self.model.layers:
            x = layer(x, batch)
        return x

    def compute_logits(
        self, hidden: torch.Tensor, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``live`` (bool ``[N]``): rows whose logits are wanted (a verify step's real
        positions); a head that can skip rows leaves the others' zeros."""
        return head_rows(self.lm_head, self.model.norm(hidden), live).float()


def head_rows(head: nn.Module, x: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``head(x)``, the rows ``live`` leaves out not computed where the head can skip them
    (``skips_rows``: hyloop's panels)."""
    if live is not None and getattr(head, "skips_rows", False):
        return head(x, live=live)
    return head(x)
