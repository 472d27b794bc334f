"""The SWA component with a window pool of its own: what an insert keeps, fills and frees.

Reference values are written out by hand for a window of 4 tokens, page_size 1.
"""

from __future__ import annotations

import torch

from hyloop.cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    UnifiedRadixCache,
)
from hyloop.pools import PageAllocator

WINDOW = 4


def make() -> tuple[UnifiedRadixCache, PageAllocator, PageAllocator]:
    kv, swa = PageAllocator(64, 1), PageAllocator(64, 1)
    cache = UnifiedRadixCache(
        kv, 1, components=("full", "swa"), sliding_window=WINDOW, swa_allocator=swa
    )
    return cache, kv, swa


def held_window(swa: PageAllocator, n: int, start: int) -> torch.Tensor:
    """A request's window-pool slots for positions ``[start, n)`` (zeros before)."""
    value = torch.zeros(n, dtype=torch.int64)
    slots = swa.alloc(n - start)
    assert slots is not None
    value[start:] = slots
    return value


def test_insert_keeps_only_the_window_before_the_end() -> None:
    cache, kv, swa = make()
    tokens = list(range(10, 22))
    value = kv.alloc(12)
    assert value is not None
    window = held_window(swa, 12, start=6)
    r = cache.insert(InsertParams(key=RadixKey(tokens), value=value, swa_value=window, swa_from=6))
    assert r.swa_taken == ((8, 12),)  # the last WINDOW tokens; 6 and 7 stay with the caller
    assert cache.total_size("full") == 12 and cache.total_size("swa") == WINDOW
    swa.free(window[6:8])  # the caller frees what the tree did not take
    cache.check_invariants()
    assert swa.available_size() == swa.capacity - WINDOW

    # A hit needs the window before it: at 12 it is there, at 10 it is not (and the window
    # before the node boundary at 8 was never kept).
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([*tokens, 99]))).prefix_len == 12
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([*tokens[:10], 99])))
    assert (m.prefix_len, m.full_prefix_len) == (0, 10)


def test_a_window_less_node_is_filled_by_a_request_that_recomputed_it() -> None:
    cache, kv, swa = make()
    tokens = list(range(10, 22))
    first = kv.alloc(12)
    assert first is not None
    window = held_window(swa, 12, start=8)
    cache.insert(InsertParams(key=RadixKey(tokens), value=first, swa_value=window, swa_from=8))
    # A second request computed the same 12 tokens and still holds the window pool's slots of
    # positions 4.. : the tree fills positions 4..8 of its window-less node (split at 4).
    second = kv.alloc(12)
    assert second is not None
    window2 = held_window(swa, 12, start=4)
    r = cache.insert(
        InsertParams(key=RadixKey(tokens), value=second, swa_value=window2, swa_from=4)
    )
    assert r.prefix_len == 12 and r.num_freed == 12  # FULL: the caller's copies are freed
    assert r.swa_taken == ((4, 8),)
    swa.free(window2[8:12])  # duplicates of the tree's window
    cache.check_invariants()
    assert cache.total_size("swa") == 8
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([*tokens[:6], 99])))
    assert m.prefix_len == 0  # only 2 window tokens before position 6
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([*tokens[:8], 99])))
    assert m.prefix_len == 8


def insert_all(
    cache: UnifiedRadixCache, kv: PageAllocator, swa: PageAllocator, tokens: list[int]
) -> None:
    """Insert ``tokens`` as a request holding every window slot; free what the tree leaves."""
    value = kv.alloc(len(tokens))
    assert value is not None
    window = held_window(swa, len(tokens), 0)
    r = cache.insert(InsertParams(key=RadixKey(tokens), value=value, swa_value=window, swa_from=0))
    keep = torch.zeros(len(tokens), dtype=torch.bool)
    for lo, hi in r.swa_taken:
        keep[lo:hi] = True
    swa.free(window[~keep])


def test_swa_eviction_tombstones_internal_nodes_and_frees_the_window_pool() -> None:
    cache, kv, swa = make()
    a, b = list(range(10, 22)), [*range(10, 18), 50, 51, 52, 53]
    insert_all(cache, kv, swa, a)  # window kept on [8, 12); [0, 8) window-less
    insert_all(cache, kv, swa, b)  # fills [0, 8) (it recomputed it) and keeps its [8, 12)
    cache.check_invariants()
    assert cache.total_size("swa") == 16
    before = swa.available_size()
    lock = cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=RadixKey(a))).last_node)
    result = cache.evict(EvictParams(swa_num_tokens=100))
    # a's window is locked; the shared [0, 8) is tombstoned, b's leaf goes whole (FULL too).
    assert result.swa_num_tokens_evicted == 12
    assert swa.available_size() == before + 12
    assert cache.total_size("full") == 12
    cache.check_invariants()
    cache.dec_lock_ref(lock.to_dec_params())
    assert cache.peek_prefix_len(RadixKey(b)) == 0
    assert cache.peek_prefix_len(RadixKey([*a, 7])) == 12
