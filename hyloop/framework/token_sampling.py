"""The token step's request table: each request's sampling and penalty tensors, declared once
(``column``) and read by ``TokenStep.step``."""

from __future__ import annotations

import dataclasses

import torch

from hyloop.framework.controls import BAD_WORD_PREFIX, BAD_WORDS
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
    seed: torch.Tensor = column(torch.int64, 0, lambda r: r.seed64)
    repetition: torch.Tensor = column(torch.float32, 1.0, lambda r: r.params.repetition_penalty)
    frequency: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.frequency_penalty)
    presence: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.presence_penalty)
    # Output token counts, bumped by the step's own kept samples; the prompt's tokens (only
    # for a repetition penalty, which counts them too).
    counts: torch.Tensor = column(torch.float32, 0.0, shape=("vocab",))
    prompt_seen: torch.Tensor = column(torch.bool, False, _prompt_seen, ("vocab",), marks=True)
    # Logits controls (``controls.py``): the additive bias row (logit_bias, allowed ids,
    # single-token bad words), min_p, the ids ``min_tokens`` masks and for how many outputs,
    # the multi-token bad words, and the step's own record of each row's last output tokens.
    bias: torch.Tensor = column(torch.float32, 0.0, lambda r: _of(r, "bias_row"), ("vocab",))
    min_p: torch.Tensor = column(torch.float32, 0.0, lambda r: r.params.min_p)
    min_tokens: torch.Tensor = column(torch.int64, 0, lambda r: r.params.min_tokens)
    min_stop: torch.Tensor = column(
        torch.bool, False, lambda r: r.controls.min_stop if r.controls else (), ("vocab",), True
    )
    words: torch.Tensor = column(
        torch.int64, -1, lambda r: _of(r, "word_table"), (BAD_WORDS, BAD_WORD_PREFIX + 1)
    )
    recent: torch.Tensor = column(torch.int64, -3, shape=(BAD_WORD_PREFIX,))
    # Structured outputs: the allowed tokens of the row's next sample (bit t of word t // 32),
    # written by the host before each step that samples it; -1 allows every token.
    grammar: torch.Tensor = column(torch.int32, -1, shape=("mask_words",))

    @classmethod
    def allocate(
        cls, rows: int, device: torch.device | str, **dims: int
    ) -> TokenSampling:  # the bitmask's words follow from the vocabulary
        if "vocab" in dims:
            dims.setdefault("mask_words", (dims["vocab"] + 31) // 32)
        return super().allocate(rows, device, **dims)


def _of(req: Request, table: str) -> torch.Tensor | None:
    return None if req.controls is None else getattr(req.controls, table)()


def penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
