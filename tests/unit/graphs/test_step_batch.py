"""The step object: a per-request tensor is declared once and read where it is used.

A new sampling field is one ``column`` line in a request table (where its value comes from) and
its use in the step; nothing else changes: not the capture buffer, not the runner, not the
scheduler. Shown here end to end on the token step kind, eager and compiled.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_batch

from hyloop.framework.requests import Request
from hyloop.framework.sampling_params import SamplingParams
from hyloop.framework.step_kinds import TokenSampling
from hyloop.graphs.capture import ArtifactKey, BucketRunner
from hyloop.graphs.capture.buffer import CaptureBuffer
from hyloop.graphs.step_batch import RequestTable, StepBatch, StepOutput, column


@dataclasses.dataclass
class ScaledSampling(TokenSampling):
    # The one declaration: a per-request logit scale from the request's own params.
    logit_scale: torch.Tensor = column(torch.float32, 1.0, lambda r: 1.0 + r.params.temperature)


def request(rid: str, temperature: float) -> Request:
    return Request(rid, [1, 2], SamplingParams(temperature=temperature), 7, 4, frozenset())


def take(table: RequestTable, row: int, req: Request) -> None:
    """What ``StepKind.bind`` does for a request new to its row."""
    if table.owners[row] is not req:
        table.take(row, req, {n: of(req) for n, of in table.sources(req.features).items()})


def test_a_column_is_written_once_per_request_and_pads_the_rest() -> None:
    table = ScaledSampling.allocate(4, "cpu", vocab=8)
    a, b = request("a", 0.5), request("b", 0.0)
    take(table, 0, a)
    take(table, 2, b)
    assert table.logit_scale.tolist() == [1.5, 1.0, 1.0, 1.0]
    assert table.temperature.tolist() == [0.5, 0.0, 0.0, 0.0]
    table.logit_scale[0] = 9.0
    take(table, 0, a)  # the same request again: its row is not rewritten
    assert table.logit_scale[0] == 9.0
    take(table, 0, request("c", 1.0))  # a new owner of the row: written afresh
    assert table.logit_scale[0] == 2.0


def test_a_new_column_reaches_eager_and_captured_steps_unchanged() -> None:
    rows, vocab = 4, 8
    table = ScaledSampling.allocate(rows + 1, "cpu", vocab=vocab)
    for i, t in enumerate((0.0, 1.0, 3.0)):
        take(table, i, request(f"r{i}", t))
    req_to_token = torch.zeros(rows + 1, 8, dtype=torch.int32)

    def step(b: StepBatch) -> StepOutput:  # the one use
        s = b.pools.requests
        assert isinstance(s, ScaledSampling)
        logits = torch.ones(b.batch_size, vocab) * s.logit_scale[b.req_rows][:, None]
        return StepOutput(b.req_rows, logits)

    ids = torch.zeros(3, 1, dtype=torch.int64)
    batch = make_batch(
        input_ids=ids,
        positions=ids,
        out_cache_loc=ids,
        req_rows=torch.tensor([2, 0, 1]),
        prefix_lens=torch.zeros(3, dtype=torch.int64),
        extend_lens=torch.ones(3, dtype=torch.int64),
        req_to_token=req_to_token,
        kv_len=1,
        is_decode=True,
    )
    batch.pools = dataclasses.replace(batch.pools, requests=table)
    batch.keep_logits = True

    class Kind:
        pools = batch.pools

        def step(self, b: StepBatch) -> StepOutput:
            return step(b)

        def prepare_capture(self, keys: list[ArtifactKey]) -> None:
            pass

    buffer = CaptureBuffer.init(4, batch.pools, kv_len=4)
    runner = BucketRunner(Kind(), buffer, backend="compile", buckets=[4], kv_len_buckets=[4])
    eager = step(batch)
    got = runner.run(batch)
    assert runner.stats()["graph_replays"] == 1
    assert got.logits is not None and eager.logits is not None
    assert torch.equal(got.logits, eager.logits)
    assert got.logits[:, 0].tolist() == [4.0, 1.0, 2.0]


def test_columns_must_be_declared_with_column() -> None:
    @dataclasses.dataclass
    class Broken(RequestTable):
        plain: torch.Tensor = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"Broken.plain: declare request tensors with column"):
        Broken.allocate(2, "cpu")
