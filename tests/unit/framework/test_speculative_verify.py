"""A verify step without features samples every position in one call: the same samples and the
same kept counts as sampling the positions one after another."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from hyloop.graphs.sampler import sample, token_hashes
from hyloop.speculative.verify import verify

VOCAB = 97


@dataclasses.dataclass
class Rows:
    """The fields of a verify ``StepBatch`` that ``verify`` and the sampler read."""

    input_ids: torch.Tensor  # [B, T]: each row's newest token, then its drafts
    extend_lens: torch.Tensor  # [B]
    req_rows: torch.Tensor  # [B]
    out_pos: torch.Tensor  # [B]
    keeps: torch.Tensor  # [B]
    num_logprobs: int = 0
    meta: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def live_positions(self) -> torch.Tensor:
        t = torch.arange(self.input_ids.shape[1])
        return t < self.extend_lens.view(-1, 1)


class Head(torch.nn.Module):
    """Fixed logits per position (padding positions hold whatever the head left there)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def compute_logits(self, hidden: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        assert hidden.shape[0] == live.shape[0] == self.logits.shape[0]
        return self.logits.clone()


def sampler(temperature: torch.Tensor, seeds: torch.Tensor) -> Any:
    hashes = token_hashes(VOCAB, "cpu")

    def draw(logits: torch.Tensor, batch: Any) -> torch.Tensor:
        rows = batch.req_rows
        top_k = torch.full_like(rows, 40)
        top_p = torch.full((rows.shape[0],), 0.9)
        return sample(
            logits, temperature[rows], top_k, top_p, seeds[rows], batch.out_pos, hashes, 64
        )

    return draw


@pytest.mark.parametrize("temperature", [0.0, 0.8, 3.0])
def test_positionwise_sampling_equals_the_positions_one_after_another(temperature: float) -> None:
    gen = torch.Generator().manual_seed(7)
    b, t = 5, 6
    logits = torch.randn(b * t, VOCAB, generator=gen) * 3
    temps = torch.tensor([temperature, 0.0, temperature, temperature, 0.5])
    seeds = torch.tensor([3, 4, 2**40 + 5, 6, 7])
    draw = sampler(temps, seeds)
    extend = torch.tensor([6, 4, 1, 6, 3])  # row 2 has no drafts; the others some padding
    rows = Rows(
        input_ids=torch.randint(0, VOCAB, (b, t), generator=gen),
        extend_lens=extend,
        req_rows=torch.tensor([4, 0, 1, 3, 2]),
        out_pos=torch.tensor([0, 9, 3, 100, 17]),
        keeps=torch.ones(b, dtype=torch.long),
    )
    hidden, head = torch.zeros(b, t, 8), Head(logits)
    # drafts that agree with the samples for a while: rows keep 1 to all of their positions
    first = verify(head, draw, hidden, rows)
    ids = rows.input_ids.clone()
    for row, agree in enumerate([5, 2, 0, 3, 1]):
        ids[row, 1 : 1 + agree] = first.next_ids[row, :agree]
    rows = dataclasses.replace(rows, input_ids=ids)
    one_by_one = verify(head, draw, hidden, rows, positionwise=False)
    at_once = verify(head, draw, hidden, rows, positionwise=True)
    assert one_by_one.accepted is not None and at_once.accepted is not None
    assert one_by_one.accepted.tolist() == [6, 3, 1, 4, 2]
    assert torch.equal(at_once.accepted, one_by_one.accepted)
    live = rows.live_positions()
    assert torch.equal(at_once.next_ids[live], one_by_one.next_ids[live])
