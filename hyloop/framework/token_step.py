"""The token step: one forward and one sampled token per row, every generation control inside.

In vLLM's order, over the last rows' logits: the structured-output masks (read once written:
``graphs.token_masks``), the logits controls (``controls.py``: bias, bad words, ``min_tokens``),
the penalties, then sampling with temperature, ``min_p``, top-k and top-p. Logprobs are the raw
model's. The step's own sampled ids update what it keeps per request (output counts, recent
tokens), so no control needs the host between steps.
"""

from __future__ import annotations

import torch

from hyloop.framework.step_kinds import StepKind, forward_all, last_rows
from hyloop.framework.token_sampling import TokenSampling
from hyloop.graphs.sampler import apply_controls, apply_penalties, sample, token_logprobs
from hyloop.graphs.step_batch import StepBatch, StepOutput
from hyloop.graphs.token_masks import await_token_masks

PROMPT_SLICE = 64  # prompt positions whose logits one pass of _prompt_logprobs holds


class TokenStep(StepKind):
    """The token step: one forward and one sampled token per row."""

    def step(self, batch: StepBatch) -> StepOutput:
        """One forward + sample. Shapes are fixed by ``batch``: capture-safe."""
        hidden = forward_all(self.model, batch)
        logits = self.model.compute_logits(last_rows(hidden, batch))
        s, rows = batch.pools.requests, batch.req_rows
        assert isinstance(s, TokenSampling)
        processed = logits  # logprobs are the raw model's (vLLM's default)
        if batch.masked:  # structured outputs (vLLM masks first)
            processed = self._grammar_mask(processed, s.grammar, rows)
        if batch.controlled:
            processed = apply_controls(
                processed,
                s.bias[rows],
                s.words[rows],
                s.recent[rows],
                s.min_stop[rows],
                batch.out_pos < s.min_tokens[rows],
            )
        if batch.penalized:
            processed = apply_penalties(
                processed,
                s.counts[rows],
                s.prompt_seen[rows],
                s.repetition[rows],
                s.frequency[rows],
                s.presence[rows],
            )
        next_ids = sample(
            processed,
            s.temperature[rows],
            s.top_k[rows],
            s.top_p[rows],
            s.seed[rows],
            batch.out_pos,
            self.tok_hash,
            batch.top_cap,
            batch.greedy_only,
            min_p=s.min_p[rows] if batch.controlled else None,
        )
        if batch.penalized:  # the step's kept samples count towards the next step's penalties
            s.counts.index_put_((rows, next_ids), batch.keeps.to(s.counts.dtype), accumulate=True)
        if batch.controlled:  # and end the rows' recent outputs (multi-token bad words)
            recent = s.recent[rows]
            shifted = torch.cat([recent[:, 1:], next_ids[:, None]], dim=1)
            s.recent[rows] = torch.where(batch.keeps[:, None] > 0, shifted, recent)
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

    def _grammar_mask(
        self, logits: torch.Tensor, table: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """``logits`` with the tokens the rows' bitmasks leave out at -inf (read once the
        masks of this step are written: ``token_masks``)."""
        bitmask = await_token_masks(table, rows, self.mask_gate)
        allowed = (bitmask[:, self.mask_word] >> self.mask_bit) & 1
        return logits.masked_fill(allowed == 0, -torch.inf)

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
