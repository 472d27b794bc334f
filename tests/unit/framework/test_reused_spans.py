"""Prefill around reused spans: the next span to compute, and what is left to compute."""

from __future__ import annotations

from hyloop.framework.requests import Request
from hyloop.framework.sampling_params import SamplingParams


def request(n: int, spans: list[tuple[int, int]]) -> Request:
    req = Request("r", list(range(n)), SamplingParams(), 0, 4, frozenset())
    req.reused_spans = spans
    return req


def test_prefill_steps_around_reused_spans() -> None:
    req = request(100, [(10, 30), (30, 50), (70, 90)])  # two adjacent runs, then another
    seen = []
    while not req.prefill_done:
        start, stop = req.next_prefill_span()
        seen.append((start, stop))
        req.num_computed = stop
    assert seen == [(0, 10), (50, 70), (90, 100)]


def test_prefill_remaining_leaves_out_reused_positions() -> None:
    req = request(100, [(10, 30), (70, 90)])
    assert req.prefill_remaining == 60
    req.num_computed = 20  # inside a span: the rest of it is written already
    assert req.prefill_remaining == 40 + 10
    req.num_computed = 75
    assert req.prefill_remaining == 10
    assert request(8, []).prefill_remaining == 8
