"""Prefix-affinity shard plans: every row once, no replica past the bound, groups kept whole."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyloop.recipes.prefix_shards import imbalance_cap, key_block, plan_shards, prefix_key


def test_key_covers_whole_pages_of_the_prefix() -> None:
    assert key_block(prefix_tokens=130, page_size=16) == 128
    assert key_block(prefix_tokens=5, page_size=16) == 16
    shared = list(range(3, 35))
    a, b = shared + [200, 201], shared + [7]
    assert prefix_key(a, 32, 4) == prefix_key(b, 32, 4)  # differ only after the block
    assert prefix_key(a, 32, 4) != prefix_key([9, *a[1:]], 32, 4)
    # A prompt shorter than the block is keyed by its whole pages, a tiny one by all of it.
    assert prefix_key(shared[:10], 32, 4) == prefix_key(shared[:8] + [250, 251], 32, 4)
    assert prefix_key([1, 2], 32, 4) != prefix_key([1, 3], 32, 4)


def test_tenants_stay_whole_and_replicas_even() -> None:
    keys = np.array([t for _ in range(16) for t in range(8)])  # 8 tenants arriving interleaved
    plan = plan_shards(keys, replicas=2, max_imbalance=1.25)
    assert plan.sizes == (64, 64)
    replica = plan.replica_of()
    for tenant in range(8):
        assert len(set(replica[keys == tenant])) == 1
    # Within a replica a tenant's rows run back to back, in input order.
    run = keys[plan.order]
    assert sum(run[1:] != run[:-1]) == 7
    for tenant in range(8):
        rows = plan.order[run == tenant]
        assert (np.diff(rows) > 0).all()


def test_a_tenant_larger_than_the_bound_is_split() -> None:
    keys = np.array([0] * 90 + [1] * 5 + [2] * 5)
    plan = plan_shards(keys, replicas=2, max_imbalance=1.2)
    assert plan.cap == 60 and max(plan.sizes) == 60 and sum(plan.sizes) == 100
    assert set(plan.replica_of()[keys == 0]) == {0, 1}


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="replicas"):
        plan_shards(np.zeros(3, dtype=np.int64), replicas=0, max_imbalance=1.5)
    with pytest.raises(ValueError, match="max_imbalance"):
        plan_shards(np.zeros(3, dtype=np.int64), replicas=2, max_imbalance=0.9)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(0, 12), max_size=200),
    replicas=st.integers(1, 6),
    max_imbalance=st.floats(1.0, 3.0),
)
def test_plan_properties(keys: list[int], replicas: int, max_imbalance: float) -> None:
    arr = np.array(keys, dtype=np.int64)
    n = len(keys)
    plan = plan_shards(arr, replicas, max_imbalance)
    assert sorted(plan.order.tolist()) == list(range(n))  # every row exactly once
    assert len(plan.sizes) == replicas and sum(plan.sizes) == n
    cap = imbalance_cap(n, replicas, max_imbalance)
    assert plan.cap == cap and max(plan.sizes) <= cap
    assert cap <= max(math.ceil(n / replicas), max_imbalance * n / replicas)
    # A split fills a replica to the bound, so at most replicas - 1 groups are ever split.
    replica = plan.replica_of()
    spans = Counter(k for k, _ in {(k, r) for k, r in zip(keys, replica.tolist(), strict=True)})
    assert sum(c - 1 for c in spans.values()) <= replicas - 1
    # Each replica runs a group's rows contiguously.
    ran = arr[plan.order]
    bounds = np.cumsum((0, *plan.sizes))
    for r in range(replicas):
        part = ran[bounds[r] : bounds[r + 1]].tolist()
        starts = [k for i, k in enumerate(part) if i == 0 or part[i - 1] != k]
        assert len(starts) == len(set(starts))
