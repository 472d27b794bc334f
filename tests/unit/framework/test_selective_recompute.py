"""The host side of selective recompute: which tokens of a prefill step are reused, each row's
quota, the static width, and the exact count of reused tokens recomputed per request."""

from __future__ import annotations

import math

import torch

from hyloop.cache.lease import IncLockRefResult, Lease
from hyloop.cache.position_independent.reuse import SelectiveRecompute
from hyloop.framework.requests import Chunk, Request
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


def test_a_selective_chunk_stretches_over_reused_tokens_at_the_same_cost() -> None:
    policy = SelectiveRecompute(ratio=0.1, check_layer=1)
    spans = [(100, 1100), (1200, 2200)]
    assert policy.cost(spans, 0, 100) == 100  # computed tokens only
    assert policy.cost(spans, 0, 1150) == 150 + 100  # 1000 reused at a tenth
    assert policy.cost(spans, 0, 2300) == 500
    assert policy.fit(spans, 0, 2300, 512) == 2300  # the whole prompt in one chunk
    n = policy.fit(spans, 0, 2300, 200)
    assert n > 200 and policy.cost(spans, 0, n) <= 200 < policy.cost(spans, 0, n + 1)
    assert policy.fit(spans, 0, 400, 512) == 400  # never past the prompt
    assert policy.fit([], 0, 2300, 512) == 512  # nothing reused: the plain limit
    assert policy.fit([(0, 100_000)], 0, 100_000, 512) == 512 * policy.max_stretch


def test_observed_attention_comes_from_each_rows_last_tokens_and_is_causal() -> None:
    from hyloop.models.blend import OBSERVERS, observed

    torch.manual_seed(0)
    b, t, heads, kv_heads, d = 2, 40, 4, 2, 8
    q, k = torch.randn(b, t, heads, d), torch.randn(b, t, kv_heads, d)
    lengths = torch.tensor([40, 25])
    a = observed(q, k, lengths, d**-0.5)
    assert a.shape == (b, t)
    assert torch.allclose(a.sum(1), torch.ones(b))  # a mean of softmax rows
    assert bool((a[1, 25:] == 0).all())  # past the row's last token: nobody attends
    # Row 0 by hand: its last OBSERVERS tokens, each head against its key/value head.
    want = torch.zeros(t)
    for o in range(t - OBSERVERS, t):
        for h in range(heads):
            s = (q[0, o, h] @ k[0, : o + 1, h // 2].T) * d**-0.5
            want[: o + 1] += s.softmax(-1)
    assert torch.allclose(a[0], want / (OBSERVERS * heads), atol=1e-6)
