"""The verify step: a row's newest token and its drafts in one forward, each position sampled
as the plain decode step at that output position samples it (``TokenStep``'s features and
sampler, which count the kept tokens before it), the drafts kept while each sample equals the
draft after it. Capture-safe: shapes follow the batch, nothing reads a value on the host."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from hyloop.graphs.sampler import token_logprobs
from hyloop.graphs.step_batch import StepBatch, StepOutput

Sample = Callable[[torch.Tensor, StepBatch], torch.Tensor]  # logits [B, V] -> ids [B]


def verify(
    model: nn.Module,
    sample: Sample,
    hidden: torch.Tensor,
    batch: StepBatch,
    positionwise: bool = False,
) -> StepOutput:
    """``hidden [B, T, H]`` of a verify ``batch`` -> each position's sample ``[B, T]`` and each
    row's count of kept tokens (``accepted``: its accepted drafts and the sample after them).
    Position ``j`` samples at output position ``out_pos + j`` with ``keeps`` the positions kept
    so far, so a feature's ``after_sample`` counts exactly the tokens decoding would have.
    ``positionwise`` (static: the step applies no feature, so a position's sample reads its
    logits, seed and output position alone): every position is sampled in one call, as its
    own row, with the same bits."""
    b, t = hidden.shape[:2]
    live = batch.live_positions()  # the padding past a row's drafts: no logits computed
    logits = model.compute_logits(hidden.reshape(b * t, -1), live.view(-1)).view(b, t, -1)
    drafts = batch.input_ids[:, 1:]
    if positionwise:
        offsets = torch.arange(t, device=batch.out_pos.device)
        flat = dataclasses.replace(
            batch,
            req_rows=batch.req_rows.repeat_interleave(t),
            out_pos=(batch.out_pos[:, None] + offsets).reshape(-1),
            keeps=live.reshape(-1).long(),
            meta={},
        )
        next_ids = sample(logits.view(b * t, -1), flat).view(b, t)
        # position j is kept where the row has it and every sample before it equals its draft
        agree = torch.cat([live[:, :1], next_ids[:, :-1] == drafts], 1).cumprod(1).bool()
        kept_mask = agree & live
    else:
        keep = batch.extend_lens > 0
        ids, kept = [], []
        for j in range(t):
            keep = keep & (batch.extend_lens > j)
            at = dataclasses.replace(batch, out_pos=batch.out_pos + j, keeps=keep.long(), meta={})
            tok = sample(logits[:, j], at)
            ids.append(tok)
            kept.append(keep)
            if j + 1 < t:
                keep = keep & (tok == drafts[:, j])
        next_ids, kept_mask = torch.stack(ids, 1), torch.stack(kept, 1)
    out = StepOutput(next_ids, logits, accepted=kept_mask.sum(1))
    if batch.num_logprobs > 0:
        parts = token_logprobs(logits.view(b * t, -1), next_ids.view(-1), batch.num_logprobs)
        lp, rank, top_lp, top_ids = (p.view(b, t, *p.shape[1:]) for p in parts)
        out.chosen_lp, out.chosen_rank, out.top_lp, out.top_ids = lp, rank, top_lp, top_ids
    return out
