"""The token step's request table: each request's sampling and penalty tensors, declared once
(``column``) and read by ``TokenStep.step``."""

from __future__ import annotations

import dataclasses

import torch

from hyloop.framework.requests import Request
from hyloop.framework.sampling_params import SamplingParams
from hyloop.graphs.step_batch import RequestTable, column


def _prompt_seen(req: Request) -> list[int]:
    return req.prompt_ids if req.params.repetition_penalty != 1.0 else []


@dataclasses.dataclass
class TokenSampling(RequestTable):
    """Per-request sampling of a token step: each ``column`` says where its value comes from,
    and ``TokenStep.step`` reads it. The padding row samples greedily."""

    temperature: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.sampling_temperature)
    top_k: torch.Tensor = column(torch.int64, -1, lambda r: r.params.filter_top_k)
    top_p: torch.Tensor = column(torch.float32, 1.0, lambda r: r.params.filter_top_p)
    seed: torch.Tensor = column(torch.int64, 0, lambda r: r.seed32)
    repetition: torch.Tensor = column(torch.float32, 1.0, lambda r: r.params.repetition_penalty)
    frequency: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.frequency_penalty)
    presence: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.presence_penalty)
    # Output token counts, bumped by the step's own kept samples; the prompt's tokens (only
    # for a repetition penalty, which counts them too).
    counts: torch.Tensor = column(torch.float32, 0.0, shape=("vocab",))
    prompt_seen: torch.Tensor = column(torch.bool, False, _prompt_seen, ("vocab",), marks=True)


def penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
