"""Donor index and planner on a bare UHRC (no model): confirmed hits only, extension to the
document's edges, tenants apart, eviction drops or re-anchors entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyloop.cache import EvictParams, InsertParams, RadixKey, UnifiedRadixCache
from hyloop.cache.position_independent.chunker import Chunker
from hyloop.cache.position_independent.index import DonorIndex, path_to
from hyloop.cache.position_independent.planner import ReusePlan, ReusePlanner
from hyloop.pools import PageAllocator


class World:
    """A tree whose inserted slots remember which token they hold (slot -> token)."""

    def __init__(self, page_size: int = 1, force_collisions: bool = False, recompute: int = 0):
        self.alloc = PageAllocator(4096, page_size)
        self.cache = UnifiedRadixCache(self.alloc, page_size=page_size)
        self.index = DonorIndex(Chunker(), force_collisions=force_collisions)
        self.cache.delete_listeners.append(self.index.on_node_deleted)
        self.planner = ReusePlanner(self.index, page_size, recompute)
        self.token_at: dict[int, int] = {}

    def insert(self, ids: list[int], extra_key: object = None) -> None:
        slots = self.alloc.alloc(len(ids))
        assert slots is not None
        key = RadixKey(ids, extra_key)
        r = self.cache.insert(InsertParams(key=key, value=slots[: len(ids)]))
        kept = slots[: r.aligned_len]
        for s, t in zip(kept.tolist(), ids, strict=False):
            self.token_at[s] = t  # a slot the tree freed and handed out again holds new text
        self.alloc.free(slots[r.aligned_len :])
        self.index.note(key, r.aligned_len, r.last_node)

    def check_plan(self, ids: list[int], plan: ReusePlan) -> None:
        """Every reused token's donor slot holds the same token (no false match)."""
        pos = 0
        for seg in plan.segments:
            assert seg.start == pos
            pos = seg.end
            if seg.kind == "reused":
                assert seg.src_slots is not None and len(seg.src_slots) == seg.length
                got = [self.token_at[s] for s in seg.src_slots.tolist()]
                assert got == ids[seg.start : seg.end]
        assert pos == len(ids)

    def check(self) -> None:
        self.index.flush()
        self.index.check()
        self.cache.check_invariants()


def rand(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 50_000, n).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_document_behind_another_prefix_is_reused_to_its_edges(page_size: int) -> None:
    rng = np.random.default_rng(0)
    w = World(page_size)
    docs = [rand(rng, int(rng.integers(500, 1000))) for _ in range(4)]
    for d in docs:
        w.insert(rand(rng, 40) + d + rand(rng, 20))
    w.check()
    sys_b = rand(rng, 100)
    query = sys_b + docs[2] + docs[0] + rand(rng, 30)
    plan = w.planner.plan(query, cached=0)
    w.check_plan(query, plan)
    doc_tokens = len(docs[2]) + len(docs[0])
    # each document is reused to within a page of both of its edges
    assert plan.reused_tokens >= doc_tokens - 4 * page_size
    deltas = {s.delta for s in plan.reused}
    assert len(deltas) == 2 and all(d != 0 for d in deltas)
    assert plan.segments[0].kind == "computed" and plan.segments[0].length >= 100


def test_recompute_tokens_leave_each_run_head_computed() -> None:
    rng = np.random.default_rng(1)
    w = World(recompute=16)
    doc = rand(rng, 700)
    w.insert(rand(rng, 40) + doc)
    query = rand(rng, 90) + doc + rand(rng, 10)
    plan = w.planner.plan(query, cached=0)
    w.check_plan(query, plan)
    (run,) = plan.reused
    assert run.start == 90 + 16 and run.end == 90 + 700


def test_exact_prefix_is_not_counted_again() -> None:
    rng = np.random.default_rng(2)
    w = World()
    doc = rand(rng, 600)
    w.insert(rand(rng, 40) + doc)
    query = rand(rng, 64) + doc
    plan = w.planner.plan(query, cached=50)
    w.check_plan(query, plan)
    assert plan.segments[0].kind == "exact" and plan.segments[0].length == 50
    assert all(s.start >= 64 for s in plan.reused)


def test_forced_collisions_never_produce_a_false_match() -> None:
    rng = np.random.default_rng(3)
    w = World(force_collisions=True)
    w.index.max_donors_per_key = 64
    docs = [rand(rng, int(rng.integers(200, 500))) for _ in range(8)]
    for d in docs[:6]:
        w.insert(rand(rng, 40) + d)
    w.check()
    assert len(w.index) >= 6  # every chunk filed under one fingerprint
    reused = 0
    for _ in range(10):
        parts = [docs[j] for j in rng.choice(8, 2, replace=False)]
        query = rand(rng, 50) + parts[0] + rand(rng, 5) + parts[1]
        plan = w.planner.plan(query, cached=0)
        w.check_plan(query, plan)
        reused += plan.reused_tokens
    assert reused > 0  # true hits are still found among the colliding candidates


def test_tenants_never_share() -> None:
    rng = np.random.default_rng(4)
    w = World()
    doc = rand(rng, 600)
    w.insert(rand(rng, 40) + doc, extra_key="a")
    query = rand(rng, 70) + doc
    assert w.planner.plan(query, 0, extra_key="b").reused_tokens == 0
    assert w.planner.plan(query, 0, extra_key=None).reused_tokens == 0
    assert w.planner.plan(query, 0, extra_key="a").reused_tokens > 500


def test_eviction_drops_or_reanchors_entries() -> None:
    rng = np.random.default_rng(5)
    w = World()
    doc = rand(rng, 800)
    base = rand(rng, 40) + doc
    w.insert(base)
    w.insert(base + rand(rng, 300))  # a child node below the document
    w.check()
    before = len(w.index)
    w.cache.evict(EvictParams(num_tokens=1))  # the child leaf goes; the document stays
    w.check()
    assert 0 < len(w.index) <= before
    query = rand(rng, 70) + doc
    plan = w.planner.plan(query, 0)
    w.check_plan(query, plan)
    assert plan.reused_tokens > 700
    w.cache.evict(EvictParams(num_tokens=10_000))
    w.check()
    assert len(w.index) == 0 and w.planner.plan(query, 0).reused_tokens == 0


def test_randomized_index_ledger() -> None:
    rng = np.random.default_rng(6)
    w = World(page_size=4)
    docs = [rand(rng, int(rng.integers(100, 400))) for _ in range(6)]
    for _step in range(60):
        op = rng.integers(3)
        if op == 0:
            w.insert(rand(rng, int(rng.integers(33, 80))) + docs[rng.integers(6)])
        elif op == 1:
            w.cache.evict(EvictParams(num_tokens=int(rng.integers(1, 400))))
        else:
            query = rand(rng, 50) + docs[rng.integers(6)] + rand(rng, 9)
            plan = w.planner.plan(query, 0)
            w.check_plan(query, plan)
            locks = [w.cache.inc_lock_ref(s.node) for s in plan.reused if s.node is not None]
            w.cache.evict(EvictParams(num_tokens=10_000))
            for s in plan.reused:  # locked donors keep their pages
                assert s.node is not None and s.node.alive and s.src_slots is not None
                held = torch.cat([n.full_value for n in path_to(s.node)])
                assert set(s.src_slots.tolist()) <= set(held.tolist())
            for lock in locks:
                w.cache.dec_lock_ref(lock)
        w.check()
        assert w.alloc.available_size() + w.cache.total_size() == w.alloc.capacity


def test_row_models_need_equal_rows_not_only_equal_keys() -> None:
    """Row keys are folded hashes: a donor whose keys match but whose rows differ is refused."""
    rng = np.random.default_rng(7)
    w = World()
    keys = rand(rng, 40) + rand(rng, 900)
    rows = rng.integers(0, 32, (len(keys), 4))
    slots = w.alloc.alloc(len(keys))
    assert slots is not None
    key = RadixKey(keys)
    r = w.cache.insert(InsertParams(key=key, value=slots))
    w.index.note(key, r.aligned_len, r.last_node, rows=rows)
    query_keys = rand(rng, 60) + keys[40:]
    same = np.concatenate([rng.integers(0, 32, (60, 4)), rows[40:]])
    other = same.copy()
    other[600, 2] += 1  # one channel of one row differs; its key (here) does not
    assert w.planner.plan(query_keys, 0, rows=same).reused_tokens > 850
    plan = w.planner.plan(query_keys, 0, rows=other)
    assert plan.reused_tokens > 300  # the rows around the differing one are still reused
    for s in plan.reused:  # reuse may stop at the differing row, never cover it
        assert not s.start <= 600 < s.end
    assert w.planner.plan(query_keys, 0).reused_tokens == 0  # a token plan never takes row donors


def test_extension_follows_the_prompt_down_the_donor_subtree() -> None:
    """Only the first part of the document was filed; the rest lies in a child node the index
    never saw. Extending right walks down into it."""
    rng = np.random.default_rng(8)
    w = World()
    head, doc = rand(rng, 40), rand(rng, 900)
    w.insert(head + doc[:700])
    slots = w.alloc.alloc(940)
    assert slots is not None
    r = w.cache.insert(InsertParams(key=RadixKey(head + doc), value=slots))  # not filed
    for s, t in zip(slots[r.prefix_len :].tolist(), (head + doc)[r.prefix_len :], strict=True):
        w.token_at[s] = t
    w.index.flush()
    assert all(e.end <= 740 for b in w.index._by_key.values() for e in b)
    query = rand(rng, 70) + doc + rand(rng, 5)
    plan = w.planner.plan(query, 0)
    w.check_plan(query, plan)
    last = plan.reused[-1]
    assert last.end == 70 + 900 and last.node is not None and last.node.depth == 940
    assert plan.reused_tokens > 850
