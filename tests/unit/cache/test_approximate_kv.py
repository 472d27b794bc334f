"""Exact and approximate KV kept apart in the UHRC, against a plain-Python reference.

An insert with ``approximate_from`` marks the pages from there on (a page holding any
approximate token is approximate); an exact-prefix match stops before them; an insert of exact
KV stops before an approximate page instead of handing its exact KV to the tree (the caller
keeps it). The reference records, per page-aligned prefix, its slots and whether it is
approximate, and recomputes every hit by brute force."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hyloop.cache import EvictParams, InsertParams, MatchPrefixParams, RadixKey, UnifiedRadixCache
from hyloop.cache.position_independent.exactness import ApproximateKV
from hyloop.pools import PageAllocator

Prefix = tuple[Any, tuple[int, ...]]


class Reference:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: dict[Prefix, tuple[list[int], bool]] = {}  # prefix -> (last page, approx)

    def hit(self, ns: Any, tokens: tuple[int, ...], approximate: bool = False) -> int:
        best = 0
        for end in range(self.ps, len(tokens) + 1, self.ps):
            page = self.pages.get((ns, tokens[:end]))
            if page is None or (page[1] and not approximate):
                break
            best = end
        return best

    def insert(
        self, ns: Any, tokens: tuple[int, ...], slots: list[int], approx_from: int | None
    ) -> tuple[int, int]:
        """``(prefix the tree held, prefix it holds now)``."""
        ps = self.ps
        aligned = len(tokens) - len(tokens) % ps
        a = aligned if approx_from is None else approx_from // ps * ps
        held = 0
        for start in range(0, aligned, ps):
            key = (ns, tokens[: start + ps])
            page = self.pages.get(key)
            if page is None:  # from here on every page is new
                for s in range(start, aligned, ps):
                    self.pages[(ns, tokens[: s + ps])] = (slots[s : s + ps], s >= a)
                return held, aligned
            if page[1] and start < a:  # exact KV stops before approximate KV
                return held, held
            held = start + ps
        return held, aligned


def tree_pages(cache: UnifiedRadixCache) -> dict[Prefix, tuple[list[int], bool]]:
    ps = cache.page_size
    out: dict[Prefix, tuple[list[int], bool]] = {}
    stack = [(child, ck[0], ()) for ck, child in cache.root.children.items()]
    while stack:
        node, ns, before = stack.pop()
        tokens = tuple(array("q", node.key))
        slots = node.component_data[0].value.tolist()
        for end in range(ps, len(tokens) + 1, ps):
            out[(ns, before + tokens[:end])] = (slots[end - ps : end], node.approximate)
        stack.extend((c, ns, before + tokens) for c in node.children.values())
    return out


def make_machine(page_size: int) -> type[RuleBasedStateMachine]:
    max_pages = 8

    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.alloc = PageAllocator(num_pages=96 if page_size == 1 else 40, page_size=page_size)
            self.cache = UnifiedRadixCache(self.alloc, page_size, marks=[ApproximateKV(page_size)])
            self.ref = Reference(page_size)
            self.keys: list[tuple[Any, tuple[int, ...]]] = []

        def _tokens(self, data: st.DataObject) -> tuple[Any, tuple[int, ...]]:
            """A fresh run of pages (plus an unaligned tail), or an earlier key cut and
            extended: prefixes are shared and diverge often."""
            pages = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=max_pages))
            run = tuple(t for p in pages for t in [p] * page_size)
            run += (2,) * data.draw(st.integers(0, page_size - 1))
            if not self.keys or data.draw(st.booleans()):
                return data.draw(st.sampled_from((None, "b"))), run
            ns, base = data.draw(st.sampled_from(self.keys))
            cut = data.draw(st.integers(0, len(base)))
            return ns, base[:cut] + run[: max(0, max_pages * page_size - cut)]

        @rule(data=st.data())
        def insert(self, data: st.DataObject) -> None:
            ns, tokens = self._tokens(data)
            approx = data.draw(st.one_of(st.none(), st.integers(0, len(tokens))))
            value = self.alloc.alloc(len(tokens))
            if value is None:
                self.cache.evict(EvictParams(num_tokens=len(tokens) + page_size))
                self._sync()
                value = self.alloc.alloc(len(tokens))
                if value is None:
                    return
            held, holds = self.ref.insert(ns, tokens, value.tolist(), approx)
            key = RadixKey(list(tokens), ns)
            r = self.cache.insert(InsertParams(key, value[: len(tokens)], approximate_from=approx))
            assert (r.prefix_len, r.aligned_len) == (held, holds)
            assert r.last_node.depth == holds
            self.alloc.free(value[holds:])  # what the tree did not take stays with the caller
            self.keys.append((ns, tokens))

        @rule(data=st.data(), approximate=st.booleans())
        def match(self, data: st.DataObject, approximate: bool) -> None:
            ns, tokens = self._tokens(data)
            want = self.ref.hit(ns, tokens, approximate)
            key = RadixKey(list(tokens), ns)
            assert self.cache.peek_prefix_len(key) == self.ref.hit(ns, tokens)
            m = self.cache.match_prefix(MatchPrefixParams(key, approximate=approximate))
            assert m.prefix_len == want
            got = m.device_indices.tolist()
            assert got == [s for e in range(page_size, want + 1, page_size) for s in
                           self.ref.pages[(ns, tokens[:e])][0]]  # fmt: skip

        @rule(num=st.integers(1, 30))
        def evict(self, num: int) -> None:
            self.cache.evict(EvictParams(num_tokens=num))
            self._sync()

        def _sync(self) -> None:
            now = tree_pages(self.cache)
            for key, page in now.items():
                assert self.ref.pages.get(key) == page, f"evict changed {key}"
            self.ref.pages = now

        @invariant()
        def consistent(self) -> None:
            assert tree_pages(self.cache) == self.ref.pages
            self.cache.check_invariants()

        def teardown(self) -> None:
            self.cache.evict(EvictParams(num_tokens=10**9))
            assert self.cache.total_size() == 0
            assert self.alloc.available_size() == self.alloc.capacity

    return Machine


@pytest.mark.parametrize("page_size", [1, 4])
def test_approximate_kv_against_reference(page_size: int) -> None:
    machine = make_machine(page_size)
    machine.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase().runTest()


def test_an_exact_node_below_approximate_kv_fails_the_check() -> None:
    alloc = PageAllocator(num_pages=64, page_size=1)
    cache = UnifiedRadixCache(alloc, 1, marks=[ApproximateKV(1)])
    value = alloc.alloc(8)
    assert value is not None
    cache.insert(InsertParams(RadixKey(list(range(8))), value, approximate_from=3))
    m = cache.match_prefix(MatchPrefixParams(RadixKey(list(range(8))), approximate=True))
    assert m.prefix_len == 8 and m.last_node.approximate
    cache.match_prefix(MatchPrefixParams(RadixKey(list(range(5))), approximate=True))  # a split
    cache.check_invariants()
    leaf = cache.match_prefix(MatchPrefixParams(RadixKey(list(range(8))), approximate=True))
    leaf.last_node.approximate = False  # what the marking must never produce
    with pytest.raises(AssertionError, match="marked exact below approximate node"):
        cache.check_invariants()
    assert torch.equal(leaf.device_indices, value)
