"""vLLM's ``min_p``: after the temperature, drop the tokens less likely than ``min_p`` times
the likeliest one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hyloop.features.base import Feature, RequestContext, bad, is_number
from hyloop.graphs.request_table import column

if TYPE_CHECKING:
    from hyloop.framework.requests import Request
    from hyloop.framework.sampling_params import SamplingParams
    from hyloop.graphs.step_batch import StepBatch


class MinP(Feature):
    name = "min_p"
    fields = {"min_p": 0.0}
    columns = {"min_p": column(torch.float32, 0.0, lambda r: r.params.min_p)}

    @classmethod
    def validate(cls, p: SamplingParams, where: str) -> None:
        if not is_number(p.min_p) or not 0.0 <= p.min_p <= 1.0:
            raise bad(where, "min_p", p.min_p, "a float in [0, 1]")

    def attach(self, req: Request, ctx: RequestContext, where: str) -> Any:
        return True if req.params.min_p > 0.0 else None

    def apply(self, logits: torch.Tensor, table: Any, batch: StepBatch) -> torch.Tensor:
        rows = batch.req_rows
        temperature, min_p = table.temperature[rows], table.min_p[rows]
        temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        # p_i < min_p * p_max  <=>  logits_i < max(logits) + temperature * log(min_p); a greedy
        # row keeps its argmax, and min_p == 0 gives -inf: nothing is dropped.
        floor = logits.max(dim=-1).values + temp * min_p.log()
        return logits.masked_fill(logits < floor[:, None], -torch.inf)
