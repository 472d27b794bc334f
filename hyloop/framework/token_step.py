"""The token step: one forward and one sampled token per row, every generation feature inside.

Over the last rows' logits, each feature the step applies (``batch.features``), in the order
``framework.FEATURES`` lists them (vLLM's: the structured-output mask, the logits
controls, the penalties, ``min_p``), then sampling with temperature, top-k and top-p. Logprobs
are the raw model's. The step's own sampled ids then update what each feature keeps per request
(output counts, recent tokens), so no feature needs the host between steps.
"""

from __future__ import annotations

import torch
from torch import nn

from hyloop.features.base import Feature
from hyloop.framework.step_kinds import StepKind, TokenSampling
from hyloop.graphs.ops import scatter_track_slots
from hyloop.graphs.sampler import sample, token_logprobs
from hyloop.graphs.step_batch import GREEDY, StepBatch, StepOutput
from hyloop.speculative.verify import verify

PROMPT_SLICE = 64  # prompt positions whose logits one pass of _prompt_logprobs holds


def forward_all(model: nn.Module, batch: StepBatch) -> torch.Tensor:
    """The model's hidden states ``[B, T, H]``; recurrent layers publish their state into the
    rows' track slots (rows without a boundary write slot 0)."""
    # NOTE: a captured step replays one view, so the per-step memo starts afresh each call
    # (stored, never read: no guard depends on what the last replay left there).
    batch.meta = {}
    hidden = model(batch)
    recurrent = batch.pools.recurrent
    if recurrent is not None:
        for buf in (*recurrent.temporal, *recurrent.conv):
            scatter_track_slots(buf, batch.state_slots, batch.track_slots)
    return hidden


def last_rows(hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """Each row's hidden state at its last real position ``[B, H]`` (a padding row's first)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, (batch.extend_lens - 1).clamp_min(0)]


def forward_last(model: nn.Module, batch: StepBatch) -> torch.Tensor:
    return last_rows(forward_all(model, batch), batch)


class TokenStep(StepKind):
    """The token step: one forward and one sampled token per row."""

    def step(self, batch: StepBatch) -> StepOutput:
        """One forward + sample. Shapes are fixed by ``batch``: capture-safe."""
        hidden = forward_all(self.model, batch)
        if batch.verify:  # a row and its drafts (``hyloop.speculative``)
            positionwise = not self._applied(batch)  # no feature: positions sampled at once
            return verify(self.model, self._sample, hidden, batch, positionwise)
        logits = self.model.compute_logits(last_rows(hidden, batch))
        next_ids = self._sample(logits, batch)
        out = StepOutput(next_ids, logits)
        if batch.num_logprobs > 0:
            out.chosen_lp, out.chosen_rank, out.top_lp, out.top_ids = token_logprobs(
                logits, next_ids, batch.num_logprobs
            )
        if batch.prompt_rows:  # eager prefill: every position's next prompt token
            out.prompt_lp, out.prompt_rank, out.prompt_top_lp, out.prompt_top_ids = (
                self._prompt_logprobs(hidden, batch)
            )
        return out

    def _sample(self, logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Each row's token from its logits: the features the step applies, then the sampler;
        then the features take the kept samples."""
        s, rows = batch.pools.requests, batch.req_rows
        assert isinstance(s, TokenSampling)
        applied = self._applied(batch)
        processed = logits  # logprobs are the raw model's (vLLM's default)
        for f in applied:
            processed = f.apply(processed, s, batch)
        next_ids = sample(
            processed,
            s.temperature[rows],
            s.top_k[rows],
            s.top_p[rows],
            s.seed[rows],
            batch.out_pos,
            self.tok_hash,
            batch.top_cap,
            bool(batch.features & GREEDY),
            argmax=batch.pools.compute.argmax,
        )
        for f in applied:
            f.after_sample(s, batch, next_ids)
        return next_ids

    def _applied(self, batch: StepBatch) -> list[Feature]:
        """The features the step applies, in ``framework.FEATURES`` order."""
        return [f for f in self.features if batch.features & f.bit]

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, ...]:
        """``token_logprobs`` of the next prompt tokens ``[B, T]`` (and the top ``[B, T, k]``) for
        the rows that want them, ``PROMPT_SLICE`` positions at a time (a vocabulary of logits
        per position); the other rows hold zeros."""
        assert batch.prompt_targets is not None
        b, t, k = hidden.shape[0], hidden.shape[1], batch.prompt_logprobs
        dev, rows = hidden.device, torch.tensor(batch.prompt_rows, device=hidden.device)
        out = [
            torch.zeros(b, t, device=dev),
            torch.zeros(b, t, dtype=torch.int64, device=dev),
            torch.zeros(b, t, k, device=dev),
            torch.zeros(b, t, k, dtype=torch.int64, device=dev),
        ]
        picked, targets = hidden[rows], batch.prompt_targets.clamp_min(0)
        for a in range(0, t, PROMPT_SLICE):
            logits = self.model.compute_logits(picked[:, a : a + PROMPT_SLICE])
            parts = token_logprobs(logits, targets[:, a : a + PROMPT_SLICE], k)
            for whole, part in zip(out, parts, strict=True):
                whole[rows, a : a + PROMPT_SLICE] = part.to(whole.dtype)
        return tuple(out)
