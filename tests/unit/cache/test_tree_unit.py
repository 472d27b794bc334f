"""Deterministic UHRC tests: locks and receipts, LRU and priority order, windows, snapshots,
pages, namespaces, the read-only probe and the no-reuse cache."""

from __future__ import annotations

import pytest
import torch

from hyloop.cache import (
    DecLockRefParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    NoReuseCache,
    RadixKey,
    UnifiedRadixCache,
)
from hyloop.pools import PageAllocator, SlotAllocator


def make(page_size: int = 1, **kw: object) -> tuple[UnifiedRadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages=4096 // page_size, page_size=page_size)
    return UnifiedRadixCache(kv_allocator=alloc, page_size=page_size, **kw), alloc  # type: ignore[arg-type]


def put(cache: UnifiedRadixCache, alloc: PageAllocator, tokens: list[int], **kw: object):
    value = alloc.alloc(len(tokens))
    assert value is not None
    r = cache.insert(
        InsertParams(key=RadixKey(tokens, kw.pop("ns", None)), value=value[: len(tokens)], **kw)
    )  # type: ignore[arg-type]
    alloc.free(value[r.aligned_len :])
    return r, value


def match(cache: UnifiedRadixCache, tokens: list[int], ns: object = None, full_only: bool = False):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, ns), full_only=full_only))


def test_insert_match_split_and_indices() -> None:
    cache, alloc = make()
    _, v = put(cache, alloc, [1, 2, 3, 4, 5])
    m = match(cache, [1, 2, 3, 9])
    assert m.prefix_len == 3 and m.device_indices.tolist() == v[:3].tolist()
    r, v2 = put(cache, alloc, [1, 2, 3, 7, 8])
    assert r.prefix_len == 3 and r.num_freed == 3  # the caller's copies of [1, 2, 3]
    assert match(cache, [1, 2, 3, 7, 8]).device_indices.tolist() == v[:3].tolist() + v2[3:].tolist()
    cache.check_invariants()


def test_reinsert_of_matched_prefix_keeps_tree_indices() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    m = match(cache, [1, 2, 3, 4])
    receipt = cache.inc_lock_ref(m.last_node)
    extra = alloc.alloc(1)
    value = torch.cat([m.device_indices, extra])  # the request's page table row
    r = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=value))
    assert (r.prefix_len, r.num_freed) == (3, 0)
    new = cache.inc_lock_ref(r.last_node)
    cache.dec_lock_ref(receipt.to_dec_params())
    cache.check_invariants()
    cache.dec_lock_ref(new.to_dec_params())
    cache.check_invariants()


def test_locked_nodes_are_never_evicted() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [5, 6])
    receipt = cache.inc_lock_ref(match(cache, [1, 2, 3]).last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    e = cache.evict(EvictParams(num_tokens=100))
    assert e.num_tokens_evicted == 2
    assert match(cache, [1, 2, 3]).prefix_len == 3
    cache.check_invariants()
    cache.dec_lock_ref(receipt.to_dec_params())
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 3
    assert alloc.available_size() == alloc.capacity


def test_release_twice_or_with_a_wrong_receipt_raises_and_changes_nothing() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4, 5])
    a = cache.inc_lock_ref(match(cache, [1, 2, 3]).last_node)
    b_node = match(cache, [4, 5]).last_node
    sizes = (cache.evictable_size(), cache.protected_size())
    with pytest.raises(ValueError, match=f"locked node {a.node_id}, got node_id {b_node.id}"):
        cache.dec_lock_ref(DecLockRefParams(receipt_id=a.receipt_id, node_id=b_node.id))
    with pytest.raises(ValueError, match="not outstanding"):
        cache.dec_lock_ref(DecLockRefParams(receipt_id=999, node_id=a.node_id))
    assert (cache.evictable_size(), cache.protected_size()) == sizes
    cache.dec_lock_ref(a.to_dec_params())
    with pytest.raises(ValueError, match="not outstanding"):
        cache.dec_lock_ref(a.to_dec_params())
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.check_invariants()


def test_eviction_follows_lru() -> None:
    cache, alloc = make()
    for t in ([1, 1], [2, 2], [3, 3]):
        put(cache, alloc, t)
    match(cache, [1, 1])  # touch the oldest: [2, 2] becomes least recent
    cache.evict(EvictParams(num_tokens=2))
    assert [cache.peek_prefix_len(RadixKey(t)) for t in ([1, 1], [2, 2], [3, 3])] == [2, 0, 2]
    cache.evict(EvictParams(num_tokens=2))
    assert [cache.peek_prefix_len(RadixKey(t)) for t in ([1, 1], [3, 3])] == [2, 0]


def test_split_under_lock_releases_balanced() -> None:
    cache, alloc = make(components=("full", "swa"), sliding_window=4)
    put(cache, alloc, list(range(10)))
    receipt = cache.inc_lock_ref(match(cache, list(range(10))).last_node)
    # The lock splits the node where the window starts and pins the window alone.
    assert cache.protected_size("swa") == 4 and cache.evictable_size("swa") == 6
    match(cache, [0, 1, 2, 3, 4, 5, 6, 77])  # splits the locked node twice over
    match(cache, [0, 1, 2, 77])
    cache.check_invariants()
    cache.dec_lock_ref(receipt.to_dec_params())
    assert cache.protected_size() == 0 and cache.protected_size("swa") == 0
    cache.check_invariants()


def test_swa_window_limits_hits_and_tombstones_interior_first() -> None:
    cache, alloc = make(components=("full", "swa"), sliding_window=3)
    put(cache, alloc, [0, 1, 2, 3, 4, 5])
    put(cache, alloc, [0, 1, 2, 3, 9])  # [0..3] becomes an interior node, LRU tail
    e = cache.evict(EvictParams(swa_num_tokens=1))
    assert (e.swa_num_tokens_evicted, e.num_tokens_evicted) == (4, 0)  # tombstone, FULL stays
    m = match(cache, [0, 1, 2, 3, 4, 5])
    # The 3 tokens before 6 include token 3, whose window KV is gone: nothing is reusable.
    assert (m.prefix_len, m.full_prefix_len) == (0, 6)
    assert match(cache, [0, 1, 2, 3, 4, 5], full_only=True).prefix_len == 6
    put(cache, alloc, [0, 1, 2, 3, 4, 5])  # recomputed by a request: window data is back
    assert match(cache, [0, 1, 2, 3, 4, 5]).prefix_len == 6
    cache.check_invariants()


def test_swa_lock_covers_only_the_window() -> None:
    cache, alloc = make(components=("full", "swa"), sliding_window=2)
    put(cache, alloc, [0, 1, 2, 3])
    put(cache, alloc, [0, 1, 2, 3, 4, 5])
    put(cache, alloc, [0, 1, 2, 3, 4, 5, 6, 7])
    receipt = cache.inc_lock_ref(match(cache, list(range(8))).last_node)
    assert cache.protected_size() == 8 and cache.protected_size("swa") == 2
    e = cache.evict(EvictParams(swa_num_tokens=100))
    assert e.swa_num_tokens_evicted == 6 and e.num_tokens_evicted == 0
    cache.check_invariants()
    cache.dec_lock_ref(receipt.to_dec_params())
    cache.check_invariants()


def test_recurrent_hits_only_at_snapshots_and_evicts_before_full() -> None:
    slots = SlotAllocator(8)
    cache, alloc = make(components=("full", "recurrent"), recurrent_allocator=slots)
    s1, s2 = (int(s) for s in slots.alloc(2))
    r = put(cache, alloc, [1, 2, 3], recurrent_slot=s1)[0]
    assert r.recurrent_taken and r.recurrent_stored
    put(cache, alloc, [1, 2, 3, 4, 5], recurrent_slot=s2)
    m = match(cache, [1, 2, 3, 4])  # FULL reaches 4, the last snapshot is at 3
    assert (m.prefix_len, m.recurrent_hit, m.recurrent_slot, m.full_prefix_len) == (3, True, s1, 4)
    assert match(cache, [1, 2]).prefix_len == 0  # no state after token 2
    # Both snapshots were used; [1,2,3]'s was refreshed last by the match above, so the
    # leaf's goes first, and with it the leaf (a leaf is priority 0 for every component).
    e = cache.evict(EvictParams(recurrent_num=1))
    assert (e.recurrent_num_evicted, e.num_tokens_evicted) == (1, 2)
    e = cache.evict(EvictParams(recurrent_num=1))
    assert (e.recurrent_num_evicted, e.num_tokens_evicted) == (1, 3)
    assert slots.available_size() == 8
    cache.check_invariants()


def test_recurrent_internal_snapshot_is_tombstoned_not_removed() -> None:
    slots = SlotAllocator(4)
    cache, alloc = make(components=("full", "recurrent"), recurrent_allocator=slots)
    s1, s2 = (int(s) for s in slots.alloc(2))
    put(cache, alloc, [1, 2, 3], recurrent_slot=s1)
    put(cache, alloc, [1, 2, 3, 4], recurrent_slot=s2)  # refreshes the leaf's snapshot
    e = cache.evict(EvictParams(recurrent_num=1))
    assert (e.recurrent_num_evicted, e.num_tokens_evicted) == (1, 0)
    assert match(cache, [1, 2, 3], full_only=True).prefix_len == 3
    assert match(cache, [1, 2, 3]).prefix_len == 0
    # A duplicate snapshot for a node that has one is freed by the tree.
    s3 = int(slots.alloc(1)[0])
    r = put(cache, alloc, [1, 2, 3, 4], recurrent_slot=s3)[0]
    assert r.recurrent_taken and not r.recurrent_stored
    cache.check_invariants()


def test_pages_split_at_multiples_and_tails_stay_with_the_caller() -> None:
    cache, alloc = make(page_size=4)
    r, _ = put(cache, alloc, list(range(10)))
    assert (r.prefix_len, r.aligned_len, cache.total_size()) == (0, 8, 8)
    m = match(cache, [0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert m.prefix_len == 4 and m.device_indices.numel() == 4
    assert cache.peek_prefix_len(RadixKey([0, 1, 2])) == 0
    cache.check_invariants()


def test_extra_key_namespaces_are_isolated() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3], ns="a")
    assert match(cache, [1, 2, 3]).prefix_len == 0
    assert match(cache, [1, 2, 3], ns="b").prefix_len == 0
    _, vb = put(cache, alloc, [1, 2, 3], ns="b")
    assert match(cache, [1, 2, 3], ns="b").device_indices.tolist() == vb[:3].tolist()
    receipt = cache.inc_lock_ref(match(cache, [1, 2, 3], ns="b").last_node)
    cache.evict(EvictParams(num_tokens=100))
    assert match(cache, [1, 2, 3], ns="a").prefix_len == 0
    assert match(cache, [1, 2, 3], ns="b").prefix_len == 3
    cache.dec_lock_ref(receipt.to_dec_params())
    cache.check_invariants()


def test_peek_is_read_only() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [7, 8])
    stamp, leaves = cache._stamp, set(cache.leaves)
    assert cache.peek_prefix_len(RadixKey([1, 2, 9])) == 2
    assert (cache._stamp, cache.leaves) == (stamp, leaves)
    cache.evict(EvictParams(num_tokens=2))  # the peek did not refresh [1, 2, 3, 4]
    assert cache.peek_prefix_len(RadixKey([1, 2, 3, 4])) == 0


def test_token_ids_as_list_tuple_or_tensor() -> None:
    cache, alloc = make()
    put(cache, alloc, [5, 6, 7])
    assert match(cache, (5, 6, 7)).prefix_len == 3
    assert cache.peek_prefix_len(RadixKey(torch.tensor([5, 6, 7], dtype=torch.int32))) == 3
    with pytest.raises(ValueError, match="1-D"):
        RadixKey(torch.zeros(2, 2, dtype=torch.int64))


def test_bad_arguments_name_the_input() -> None:
    alloc = PageAllocator(16, 1)
    with pytest.raises(ValueError, match="components must be one of"):
        UnifiedRadixCache(kv_allocator=alloc, components=("full", "swa", "recurrent"))
    with pytest.raises(ValueError, match="sliding_window"):
        UnifiedRadixCache(kv_allocator=alloc, components=("full", "swa"))
    cache = UnifiedRadixCache(kv_allocator=alloc)
    with pytest.raises(ValueError, match="one index per token"):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=torch.tensor([3])))


def test_no_reuse_cache() -> None:
    alloc = PageAllocator(64, 4)
    cache = NoReuseCache(kv_allocator=alloc, page_size=4)
    value = alloc.alloc(6)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3])))
    assert (m.prefix_len, m.device_indices.numel(), m.last_node) == (0, 0, cache.root)
    r = cache.insert(InsertParams(key=RadixKey(list(range(6))), value=value[:6]))
    assert (r.prefix_len, r.aligned_len) == (0, 4)
    alloc.free(value[4:])
    receipt = cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(receipt.to_dec_params())
    with pytest.raises(ValueError, match="not outstanding"):
        cache.dec_lock_ref(receipt.to_dec_params())
    assert cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 0
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)
    cache.check_invariants()


# -- the ledger checks can fail ----------------------------------------------------------------


def test_allocator_check_catches_a_duplicate_and_a_stale_mark() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4)
    alloc.check_invariants()
    dup = PageAllocator(num_pages=16, page_size=4)
    dup._stack[0] = dup._stack[1]  # one page listed twice, another lost
    with pytest.raises(AssertionError, match="duplicate"):
        dup.check_invariants()
    stale = PageAllocator(num_pages=16, page_size=4)
    stale._is_free[int(stale._stack[0])] = False  # listed free, marked taken
    stale._is_free[0] = True
    with pytest.raises(AssertionError, match="disagree"):
        stale.check_invariants()


def test_ledger_catches_a_tree_page_on_the_free_list() -> None:
    cache, alloc = make(page_size=4)
    _, value = put(cache, alloc, list(range(1, 9)))
    cache.check_invariants()
    page = int(value[0]) // 4
    alloc._push(alloc._order[page : page + 1].copy())  # the tree's page handed back too early
    with pytest.raises(AssertionError, match="both free and in the tree"):
        cache.check_invariants()
