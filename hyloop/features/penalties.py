"""vLLM's repetition, presence and frequency penalties, in the step.

Three scalar columns, a ``[vocab]`` count of the output's tokens that the step bumps with its own
kept samples, and the prompt's tokens (only for a repetition penalty, which counts them too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hyloop.features.base import (
    FLOAT32_MAX,
    Feature,
    RequestContext,
    bad,
    is_float32,
    is_number,
)
from hyloop.graphs.request_table import column
from hyloop.graphs.sampler import repeated

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams
    from hyloop.graphs.step_batch import StepBatch


def _prompt_seen(req: Request) -> list[int]:
    return req.prompt_ids if req.params.repetition_penalty != 1.0 else []


class Penalties(Feature):
    name = "penalties"
    fields = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    flag = "penalized"
    columns = {
        "repetition": column(torch.float32, 1.0, lambda r: r.params.repetition_penalty),
        "frequency": column(torch.float32, 0.0, lambda r: r.params.frequency_penalty),
        "presence": column(torch.float32, 0.0, lambda r: r.params.presence_penalty),
        "counts": column(torch.float32, 0.0, shape=("vocab",)),
        "prompt_seen": column(torch.bool, False, _prompt_seen, ("vocab",), marks=True),
    }

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(p, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(where, name, value, "a float in [-2, 2]")
        rep = p.repetition_penalty
        if not is_float32(rep) or not rep > 0.0:
            raise bad(where, "repetition_penalty", rep, f"a float in (0, {FLOAT32_MAX:.4g}]")

    def attach(self, req: Request, ctx: RequestContext, where: str) -> Any:
        p = req.params
        used = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
        return True if used or p.presence_penalty != 0.0 else None

    def apply(self, logits: torch.Tensor, table: Any, batch: StepBatch) -> torch.Tensor:
        """vLLM's penalties: the repetition penalty divides a positive (multiplies a negative)
        logit of a token seen in the prompt or the output; ``frequency * count`` is subtracted,
        and ``presence`` once for each token the output holds. Neutral values (1, 0, 0) leave a
        row's logits bit-exact."""
        rows = batch.req_rows
        counts = table.counts[rows]
        seen = counts > 0
        penalized = repeated(logits, table.repetition[rows][:, None])
        logits = torch.where(seen | table.prompt_seen[rows], penalized, logits)
        logits = logits - table.frequency[rows][:, None] * counts
        return logits - table.presence[rows][:, None] * seen.to(logits.dtype)

    def after_sample(self, table: Any, batch: StepBatch, ids: torch.Tensor) -> None:
        # the step's kept samples count towards the next step's penalties
        keeps = batch.keeps.to(table.counts.dtype)
        table.counts.index_put_((batch.req_rows, ids), keeps, accumulate=True)
