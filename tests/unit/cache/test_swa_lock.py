"""The SWA lock pins exactly the window its holder reads, and slides on with it.

A lock at a node splits the path where the window (page rounded) starts, and into nodes of at
most ``lock_granule`` tokens; ``pinned_size`` counts what it pins; ``release_before`` lets go of
the nodes a sliding window has passed, FULL staying locked; the receipt then releases exactly
what is left. A plain recount over the path is the reference, and the tree's own
``check_invariants`` (lock refs against receipts, sizes) runs after every operation. The window
pool's ledger (``SWAWindows``) counts what a lock pins against its request's reservation.
"""

from __future__ import annotations

import pytest
import torch

from hyloop.cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    NoReuseCache,
    RadixKey,
    UnifiedRadixCache,
)
from hyloop.cache.node import SWA
from hyloop.pools import PageAllocator, SWAKVPool, SWAWindows


def make(window: int, page_size: int = 1, granule: int | None = None) -> UnifiedRadixCache:
    alloc = PageAllocator(num_pages=4096 // page_size, page_size=page_size)
    return UnifiedRadixCache(
        kv_allocator=alloc,
        page_size=page_size,
        components=("full", "swa"),
        sliding_window=window,
        swa_lock_granule=granule,
    )


def put(cache: UnifiedRadixCache, n: int) -> None:
    value = cache.kv_allocator.alloc(n)
    assert value is not None
    cache.insert(InsertParams(key=RadixKey(list(range(n))), value=value[:n]))


def node_at(cache: UnifiedRadixCache, depth: int):  # type: ignore[no-untyped-def]
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(depth)))))
    assert m.prefix_len == depth
    return m.last_node


def locked_spans(cache: UnifiedRadixCache, node) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """``(start, end)`` of every node on the path whose window data is locked (recounted)."""
    spans = []
    while node.parent is not None:
        if node.component_data[SWA].lock_ref:
            spans.append((node.start_depth, node.depth))
        node = node.parent
    return sorted(spans)


@pytest.mark.parametrize(
    ("page_size", "window", "depth", "start"),
    [(1, 4, 10, 6), (1, 20, 32, 12), (4, 6, 16, 8), (16, 20, 96, 64), (1, 8, 5, 0)],
)
def test_a_lock_pins_exactly_the_page_rounded_window(
    page_size: int, window: int, depth: int, start: int
) -> None:
    cache = make(window, page_size)
    put(cache, 128)
    node = node_at(cache, depth)
    receipt = cache.inc_lock_ref(node)
    cache.check_invariants()
    assert locked_spans(cache, node) == [(start, depth)]
    assert cache.pinned_size(receipt, "swa") == depth - start == cache.protected_size("swa")
    assert receipt.swa_start_depth == start
    cache.dec_lock_ref(receipt)
    assert cache.protected_size("swa") == 0 == cache.protected_size("full")
    cache.check_invariants()


def test_the_granule_splits_the_window_and_release_before_slides_it() -> None:
    cache = make(window=6, granule=2)
    put(cache, 12)
    node = node_at(cache, 12)
    receipt = cache.inc_lock_ref(node)
    assert locked_spans(cache, node) == [(6, 8), (8, 10), (10, 12)]
    other = cache.inc_lock_ref(node_at(cache, 10))  # a second reader: window [4, 10)
    cache.check_invariants()
    receipt = cache.release_before(receipt, 9)  # reads from 9 on: [6, 8) is behind it
    assert receipt.swa_start_depth == 8 and cache.pinned_size(receipt, "swa") == 4
    assert (6, 8) in locked_spans(cache, node)  # still the other reader's
    cache.check_invariants()
    receipt = cache.release_before(receipt, 12)  # the window moved past the whole lock
    assert cache.pinned_size(receipt, "swa") == 0
    assert cache.protected_size("full") == 12  # FULL stays locked for its holder
    cache.check_invariants()
    cache.dec_lock_ref(other)
    assert locked_spans(cache, node) == [] and cache.protected_size("swa") == 0
    cache.dec_lock_ref(receipt)
    assert cache.protected_size("full") == 0
    cache.check_invariants()


def test_released_window_is_evictable_and_a_later_hit_is_cut_there() -> None:
    cache = make(window=4, granule=4)
    put(cache, 16)
    receipt = cache.inc_lock_ref(node_at(cache, 16))
    receipt = cache.release_before(receipt, 14)  # [12, 16) stays pinned
    cache.evict(EvictParams(swa_num_tokens=10**6))
    cache.check_invariants()
    assert cache.total_size("swa") == 4 == cache.pinned_size(receipt, "swa")
    probe = cache.peek_prefix_len(RadixKey(list(range(12))))
    assert probe == 0  # every window before 12 was evicted: no hit there
    cache.dec_lock_ref(receipt)
    cache.check_invariants()


def test_release_before_refuses_a_receipt_that_is_not_outstanding() -> None:
    cache = make(window=4)
    put(cache, 8)
    receipt = cache.inc_lock_ref(node_at(cache, 8))
    cache.dec_lock_ref(receipt)
    with pytest.raises(ValueError, match="not outstanding"):
        cache.release_before(receipt, 8)
    with pytest.raises(ValueError, match="not outstanding"):
        cache.pinned_size(receipt, "swa")
    none = NoReuseCache(cache.kv_allocator, components=("full", "swa"), sliding_window=4)
    r = none.release_before(none.inc_lock_ref(none.root), 5)  # a root receipt pins nothing
    assert none.pinned_size(r, "swa") == 0 and none.pinned_size(r, "full") == 0
    none.dec_lock_ref(r)
    assert none.num_outstanding_locks() == 0


def windows(pages: int, page_size: int = 1, window: int = 4, chunk: int = 4) -> SWAWindows:
    pool = SWAKVPool(1, pages, page_size, 1, 8, 4096, window, torch.float32, "cpu")
    return SWAWindows(pool, chunk)


def test_the_window_ledger_counts_pinned_pages_against_the_reservation() -> None:
    w = windows(pages=40)  # 39 usable; one request's worst case is 4 + 4 + 3 = 11
    # (The tree is not part of this test: its 4 pinned pages are a stated count.)
    w.reserve("a", positions=100, total_len=50, cached=40, pinned=4)
    # What it is owed is its reservation less what its lock pins.
    assert w.shortfall(100, 50) == (11 - 4) + 11 - 39
    assert w.shortfall(100, 50, pinned=4) == (11 - 4) + (11 - 4) - 39
    slots = torch.arange(4096, dtype=torch.int64)
    w.advance("a", slots, 40, 44, 100)  # 4 own pages next to the 4 pinned
    w.check({"a"}, tree_held_tokens=0, pinned={"a": 4})
    with pytest.raises(AssertionError, match="charged 4 pinned pages, its lock pins 5"):
        w.check({"a"}, tree_held_tokens=0, pinned={"a": 5})
    w.set_pinned("a", 8)  # over: 4 held + 8 pinned > 11 reserved
    with pytest.raises(AssertionError, match="holds 4 pages and pins 8, reserved 11"):
        w.check({"a"}, tree_held_tokens=0, pinned={"a": 8})
    w.set_pinned("a", 4)
    assert w.room([("a", 44, 48)]) and not w.room([("a", 44, 44 + 40)])
    # Decoding: the reservation shrinks to the decode worst case plus what is still pinned.
    w.advance("a", slots, 99, 100, 100)
    assert w._held["a"].reserved == min(11, 4 + 1 + 3 + 4)
