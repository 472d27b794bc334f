"""The one deferred-free rule, as every pool follows it: a free waits for unretired steps."""

from __future__ import annotations

import pytest
import torch

from hyloop.pools import KVPool, PageAllocator, ReqToTokenPool, StepFence
from hyloop.pools.step_fence import DeferredFrees


def test_fence_generations() -> None:
    fence = StepFence()
    assert fence.idle and fence.defer_gen is None
    a, b = fence.issue(), fence.issue()
    assert (a, b) == (1, 2) and fence.defer_gen == 2  # a free waits for the newest launch
    released: list[int] = []
    fence.attach(released.append)
    fence.retire(1)
    assert released == [1] and fence.defer_gen == 2 and not fence.idle
    fence.retire(2)
    assert fence.idle and fence.defer_gen is None
    fence.retire(1)  # retiring an older generation again changes nothing
    assert released == [1, 2, 2] and fence.retired == 2
    with pytest.raises(ValueError, match="only 2 issued"):
        fence.retire(3)


def test_deferred_frees_take_through() -> None:
    d: DeferredFrees[str] = DeferredFrees()
    for gen, item in ((1, "a"), (3, "b"), (2, "c")):
        d.park(gen, item)
    assert d.take_through(2) == ["a", "c"] and d.items() == ["b"] and len(d) == 1
    assert d.take_through(2) == []
    assert d.take_through(None) == ["b"] and len(d) == 0


def test_page_allocator_frees_wait_for_the_launched_step() -> None:
    fence = StepFence()
    alloc = PageAllocator(num_pages=9, page_size=4, fence=fence)
    a, b = alloc.alloc(8), alloc.alloc(4)
    assert a is not None and b is not None
    alloc.free(a[:4])  # nothing in flight: immediate
    assert alloc.num_free_pages() == 6 and alloc.pending_size() == 0
    gen = fence.issue()
    alloc.free(a[4:])
    alloc.free(b)
    assert alloc.num_free_pages() == 6 and alloc.pending_size() == 8
    alloc.check_invariants()
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)  # a pending page is not free again
    fence.retire(gen)
    assert alloc.num_free_pages() == 8 and alloc.pending_size() == 0
    alloc.check_invariants()


def test_req_to_token_rows_wait_for_the_launched_step() -> None:
    fence = StepFence()
    pool = ReqToTokenPool(max_requests=3, max_context=8, device="cpu", fence=fence)
    rows = [pool.alloc() for _ in range(3)]
    assert None not in rows and pool.alloc() is None
    g1 = fence.issue()
    pool.free(rows[0])  # waits for g1
    g2 = fence.issue()
    pool.free(rows[1])  # waits for g2
    assert pool.available() == 0 and pool.pending_size() == 2
    with pytest.raises(ValueError, match="bad free"):
        pool.free(rows[0])
    fence.retire(g1)
    assert pool.available() == 1 and pool.pending_size() == 1
    fence.retire(g2)
    assert pool.available() == 2
    pool.free(rows[2])  # idle again: immediate
    assert pool.available() == 3


def test_one_fence_serves_every_pool() -> None:
    fence = StepFence()
    kv = KVPool(1, 5, 2, 1, 4, torch.float32, "cpu", fence)
    table = ReqToTokenPool(2, 8, "cpu", fence)
    slots, row = kv.allocator.alloc(4), table.alloc()
    assert slots is not None and row is not None
    gen = fence.issue()
    kv.allocator.free(slots)
    table.free(row)
    assert kv.allocator.pending_size() == 4 and table.pending_size() == 1
    fence.retire(gen)
    assert kv.allocator.pending_size() == 0 and table.pending_size() == 0
    assert kv.allocator.num_free_pages() == 4 and table.available() == 2
