"""The host side of selective recompute: which tokens of a prefill step are reused, each row's
quota, the static width, and the exact count of reused tokens recomputed per request."""

from __future__ import annotations

import math

import torch

from hyloop.cache.lease import IncLockRefResult, Lease
from hyloop.framework.requests import Chunk, Request
from hyloop.framework.reuse import SelectiveRecompute
from hyloop.framework.sampling_params import SamplingParams


def chunk(
    policy: SelectiveRecompute, start: int, length: int, spans: list[tuple[int, int]]
) -> Chunk:
    req = Request("r", list(range(1000)), SamplingParams(), 0, 4, frozenset())
    lock = IncLockRefResult(receipt_id=0, node=None, delta=0)  # type: ignore[arg-type]
    req.lease = Lease(torch.arange(1000), 0, lock, 0, blend_spans=spans, selective=policy)
    return Chunk(req, start, length)


def test_each_row_recomputes_its_share_of_the_reused_tokens_in_the_chunk() -> None:
    policy = SelectiveRecompute(ratio=0.1, check_layer=1)
    chunks = [
        chunk(policy, 0, 512, [(40, 300), (310, 900)]),  # 260 + 202 reused, 50 computed
        chunk(policy, 512, 300, [(40, 300), (310, 900)]),  # 300 reused
        chunk(policy, 0, 100, []),  # nothing reused
    ]
    blend = policy.blend(chunks, 512, lambda t: t)
    assert blend is not None and blend.check_layer == 1
    reused = [462, 300, 0]
    assert blend.reused.sum(1).tolist() == reused
    assert bool(blend.reused[0, 40:300].all()) and not bool(blend.reused[0, 300:310].any())
    assert not bool(blend.reused[1, 300:].any())  # past the row's chunk
    quota = [c.length - n + math.ceil(0.1 * n) for c, n in zip(chunks, reused, strict=True)]
    assert blend.quota.tolist() == quota and blend.keep == max(quota) < 512
    assert [c.req.num_recomputed for c in chunks] == [47, 30, 0]
    assert policy.recomputed == 77


def test_a_step_that_saves_nothing_runs_every_token_and_counts_them_all() -> None:
    policy = SelectiveRecompute(ratio=0.5, check_layer=1)
    # The first row computes all 400 of its tokens: no narrower width serves both rows.
    chunks = [chunk(policy, 0, 400, []), chunk(policy, 0, 400, [(0, 300)])]
    assert policy.blend(chunks, 400, lambda t: t) is None
    assert [c.req.num_recomputed for c in chunks] == [0, 300]
    other = SelectiveRecompute(ratio=0.5, check_layer=1)  # another engine's policy: not ours
    assert other.blend([chunk(policy, 0, 400, [(0, 300)])], 400, lambda t: t) is None
    assert other.recomputed == 0
