"""The step function a graph backend captures, and its typed IO.

``run_step(model, ctx, sampling, tok_hash)`` is one forward + sample over a ``StepContext``:
forward, the recurrent track-slot scatter, last-row logits, sampling, logprobs and (for
multi-channel rows) the row radix keys, all tensor ops with no host sync. Its inputs are a
``StepContext`` and ``SamplingTensors`` (a view of ``StepInputs``' sampling fields, no copy); its
output is a ``StepOutput``, which travels unchanged from the captured step to the resolve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyloop.graphs.context import StepContext
from hyloop.graphs.ops import row_keys, scatter_track_slots
from hyloop.graphs.sampler import sample
from hyloop.graphs.static_inputs import StepInputs


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] f32
    top_k: torch.Tensor  # [B] int64 (vocab size when disabled)
    top_p: torch.Tensor  # [B] f32
    seeds: torch.Tensor  # [B] int64, 32-bit values
    out_pos: torch.Tensor  # [B] int64 index of the token being sampled in the output
    top_cap: int  # static: sampler candidates (``sampler.candidate_cap``)
    num_logprobs: int  # static: top-k logprobs to return (0 = none)
    greedy_only: bool = False  # static: every row is greedy (eager path only)

    @classmethod
    def of(cls, inputs: StepInputs, greedy_only: bool = False) -> SamplingTensors:
        """The sampling fields of ``inputs`` (the same tensors)."""
        return cls(
            inputs.temperature,
            inputs.top_k,
            inputs.top_p,
            inputs.seeds,
            inputs.out_pos,
            inputs.top_cap,
            inputs.num_logprobs,
            greedy_only,
        )


@dataclass
class StepOutput:
    next_ids: torch.Tensor  # [B] int64 (multi-channel models: the row keys)
    logits: torch.Tensor | None = None  # [B, V] (or [B, C, V]) fp32 when asked
    top_lp: torch.Tensor | None = None  # [B, K] logprobs of the top tokens
    top_ids: torch.Tensor | None = None  # [B, K]
    chosen_lp: torch.Tensor | None = None  # [B] logprob of the sampled token
    next_rows: torch.Tensor | None = None  # [B, C] multi-channel models

    @property
    def feedback(self) -> torch.Tensor:
        """What the next decode step reads as its input: the rows, or the token ids."""
        return self.next_rows if self.next_rows is not None else self.next_ids


def forward_last(model: nn.Module, ctx: StepContext) -> torch.Tensor:
    """The model's hidden state at each row's last position ``[B, H]``; recurrent layers
    publish their state into the rows' track slots (rows without a boundary write slot 0)."""
    hidden = model(ctx)
    if ctx.recurrent is not None:
        for buf in (*ctx.recurrent.temporal, *ctx.recurrent.conv):
            scatter_track_slots(buf, ctx.state_slots, ctx.track_slots)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, ctx.last_index]


def run_step(
    model: nn.Module,
    ctx: StepContext,
    st: SamplingTensors,
    tok_hash: torch.Tensor,
    keep_logits: bool = False,
) -> StepOutput:
    """One forward + sample. Shapes are fixed by ``ctx`` and ``st``: capture-safe."""
    last = forward_last(model, ctx)
    logits = model.compute_logits(last)
    kept = logits if keep_logits else None
    if logits.dim() == 3:  # multi-channel rows: sample every channel, key the row
        b, c, _ = logits.shape
        channel = torch.arange(c, device=logits.device).repeat(b)
        next_rows = sample(
            logits.reshape(b * c, -1),
            st.temperature.repeat_interleave(c),
            st.top_k.repeat_interleave(c),
            st.top_p.repeat_interleave(c),
            st.seeds.repeat_interleave(c),
            st.out_pos.repeat_interleave(c) * c + channel,
            tok_hash,
            st.top_cap,
            st.greedy_only,
        ).view(b, c)
        return StepOutput(row_keys(next_rows, model.end_id), kept, next_rows=next_rows)
    next_ids = sample(
        logits,
        st.temperature,
        st.top_k,
        st.top_p,
        st.seeds,
        st.out_pos,
        tok_hash,
        st.top_cap,
        st.greedy_only,
    )
    if st.num_logprobs == 0:
        return StepOutput(next_ids, kept)
    lp = logits.log_softmax(dim=-1)
    chosen = lp.gather(1, next_ids[:, None]).squeeze(1)
    top_lp, top_ids = lp.topk(st.num_logprobs, dim=-1)
    return StepOutput(next_ids, kept, top_lp, top_ids, chosen)
