"""Stateful property tests: random insert / match / lock / unlock / evict / peek sequences on
the UHRC against a plain-Python reference model, for page sizes 1 and 16 and each component
set. ``check_invariants()`` runs after every step."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hyloop.cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    UnifiedRadixCache,
)
from hyloop.pools import PageAllocator, SlotAllocator

sys.path.insert(0, str(Path(__file__).parent))
from reference import ReferenceCache, tree_prefixes  # noqa: E402

NAMESPACES = (None, "tenant-b")


def make_machine(page_size: int, components: tuple[str, ...]) -> type[RuleBasedStateMachine]:
    # Keys are short runs over a tiny vocabulary, so prefixes are shared and diverge often.
    max_pages = 10 if page_size == 1 else 6

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.alloc = PageAllocator(num_pages=160 if page_size == 1 else 48, page_size=page_size)
            kwargs: dict[str, Any] = {}
            self.slots: SlotAllocator | None = None
            if "swa" in components:
                # Under two pages, so tombstones a page back already block a hit.
                kwargs["sliding_window"] = 3 if page_size == 1 else page_size + page_size // 2
            if "recurrent" in components:
                self.slots = SlotAllocator(12)
                kwargs["recurrent_allocator"] = self.slots
            self.cache = UnifiedRadixCache(
                kv_allocator=self.alloc, page_size=page_size, components=components, **kwargs
            )
            self.ref = ReferenceCache(
                page_size=page_size,
                window=kwargs.get("sliding_window"),
                recurrent="recurrent" in components,
            )
            self.keys: list[tuple[Any, tuple[int, ...]]] = []
            self.locks: list[tuple[Any, tuple[Any, tuple[int, ...]]]] = []

        def _run(self, data: st.DataObject, max_pages: int, min_pages: int = 0) -> tuple[int, ...]:
            """Whole pages (two tokens decide a page, so pages diverge at either end of it)
            plus, sometimes, an unaligned tail."""
            pages = data.draw(
                st.lists(
                    st.tuples(st.integers(0, 2), st.integers(0, 1)),
                    min_size=min(min_pages, max_pages),
                    max_size=max_pages,
                )
            )
            out: list[int] = []
            for head, last in pages:
                out += [head] * (page_size - 1) + [last] if page_size > 1 else [head + last]
            tail = data.draw(st.integers(0, page_size - 1)) if page_size > 1 else 0
            return tuple(out) + (2,) * tail

        def _tokens(self, data: st.DataObject) -> tuple[Any, tuple[int, ...]]:
            """A fresh key, or an earlier key: as is, extended, or cut and diverging."""
            mode = data.draw(st.integers(0, 3)) if self.keys else 0
            if mode == 0:
                return data.draw(st.sampled_from(NAMESPACES)), self._run(
                    data, max_pages, max_pages // 2
                )
            ns, base = data.draw(st.sampled_from(self.keys))
            if mode == 1:
                return ns, base
            cut = len(base) if mode == 2 else data.draw(st.integers(0, len(base)))
            cut -= cut % page_size
            room = max(0, max_pages - cut // page_size)
            return ns, base[:cut] + self._run(data, room)

        def _sync_after_evict(self) -> None:
            """Adopt the tree's prefixes after an evict, checking it only removed things."""
            now = tree_prefixes(self.cache)
            for key, (slots, swa, rec) in now.items():
                entry = self.ref.prefixes.get(key)
                assert entry is not None, f"evict created prefix {key}"
                assert slots == entry.slots, f"evict moved prefix {key} to slots {slots}"
                assert entry.swa or not swa, f"evict revived SWA data at {key}"
                assert entry.rec or not rec, f"evict created a snapshot at {key}"
                entry.swa, entry.rec = swa, rec
            for key in list(self.ref.prefixes):
                if key not in now:
                    del self.ref.prefixes[key]
            for _, (ns, path) in self.locks:
                assert len(path) == 0 or (ns, path) in now, f"evict removed locked {path}"

        @rule(data=st.data(), with_snapshot=st.booleans())
        def insert(self, data: st.DataObject, with_snapshot: bool) -> None:
            ns, tokens = self._tokens(data)
            value = self.alloc.alloc(len(tokens))
            if value is None:
                self.cache.evict(EvictParams(num_tokens=len(tokens) + page_size))
                self._sync_after_evict()
                value = self.alloc.alloc(len(tokens))
                if value is None:
                    return
            slot = None
            if self.slots is not None and with_snapshot:
                got = self.slots.alloc(1)
                if got is None:
                    self.cache.evict(EvictParams(recurrent_num=1))
                    self._sync_after_evict()
                    got = self.slots.alloc(1)
                slot = None if got is None else int(got[0])
            held = self.ref.insert(ns, tokens, value.tolist(), slot is not None)
            r = self.cache.insert(
                InsertParams(
                    key=RadixKey(list(tokens), ns), value=value[: len(tokens)], recurrent_slot=slot
                )
            )
            assert r.prefix_len == held
            assert r.aligned_len == len(tokens) - len(tokens) % page_size
            assert r.last_node.depth == r.aligned_len
            # The request frees what stays with it: the unaligned tail and an untaken slot.
            self.alloc.free(value[r.aligned_len :])
            if slot is not None and not r.recurrent_taken:
                self.slots.free([slot])
            if tokens:
                self.keys.append((ns, tokens))

        @rule(data=st.data(), full_only=st.booleans(), lock=st.booleans())
        def match(self, data: st.DataObject, full_only: bool, lock: bool) -> None:
            ns, tokens = self._tokens(data)
            want = self.ref.hit(ns, tokens, full_only)
            m = self.cache.match_prefix(
                MatchPrefixParams(
                    key=RadixKey(torch.tensor(tokens, dtype=torch.int64), ns), full_only=full_only
                )
            )
            assert m.prefix_len == want
            assert m.device_indices.tolist() == self.ref.slots(ns, tokens, want)
            assert m.last_node.depth == want
            assert m.full_prefix_len == self.ref.full_match(ns, tokens)
            if lock:
                receipt = self.cache.inc_lock_ref(m.last_node)
                self.locks.append((receipt, (ns, tokens[:want])))

        @precondition(lambda self: self.locks)
        @rule(data=st.data())
        def unlock(self, data: st.DataObject) -> None:
            i = data.draw(st.integers(0, len(self.locks) - 1))
            receipt, _ = self.locks.pop(i)
            self.cache.dec_lock_ref(receipt.to_dec_params())
            sizes = (self.cache.evictable_size(), self.cache.protected_size())
            with pytest.raises(ValueError, match="not outstanding"):
                self.cache.dec_lock_ref(receipt.to_dec_params())
            assert (self.cache.evictable_size(), self.cache.protected_size()) == sizes

        @rule(
            num=st.integers(0, 40),
            swa=st.integers(0, 40),
            rec=st.integers(0, 3),
        )
        def evict(self, num: int, swa: int, rec: int) -> None:
            e = self.cache.evict(EvictParams(num_tokens=num, swa_num_tokens=swa, recurrent_num=rec))
            self._sync_after_evict()
            assert e.num_tokens_evicted >= 0
            if e.num_tokens_evicted < num:
                assert self.cache.evictable_size() == 0
            if "swa" in components and e.swa_num_tokens_evicted < swa:
                assert self.cache.evictable_size("swa") == 0
            if "recurrent" in components and e.recurrent_num_evicted < rec:
                assert self.cache.evictable_size("recurrent") == 0

        @rule(swa=st.integers(1, 2 * page_size))
        def evict_window_data(self, swa: int) -> None:
            """Small SWA evictions tombstone interior nodes instead of removing whole leaves."""
            e = self.cache.evict(EvictParams(swa_num_tokens=swa))
            self._sync_after_evict()
            assert e.swa_num_tokens_evicted >= 0

        @rule(data=st.data())
        def peek(self, data: st.DataObject) -> None:
            ns, tokens = self._tokens(data)
            before = (self.cache._stamp, len(tree_prefixes(self.cache)), len(self.cache.leaves))
            assert self.cache.peek_prefix_len(RadixKey(tokens, ns)) == self.ref.hit(ns, tokens)
            after = (self.cache._stamp, len(tree_prefixes(self.cache)), len(self.cache.leaves))
            assert before == after

        @invariant()
        def consistent(self) -> None:
            self.cache.check_invariants()
            self.alloc.check_invariants()
            assert self.cache.num_outstanding_locks() == len(self.locks)

        def teardown(self) -> None:
            for receipt, _ in self.locks:
                self.cache.dec_lock_ref(receipt.to_dec_params())
            self.cache.evict(
                EvictParams(num_tokens=10**9, swa_num_tokens=10**9, recurrent_num=10**9)
            )
            self.cache.check_invariants()
            assert self.cache.total_size() == 0
            assert self.alloc.available_size() == self.alloc.capacity

    return CacheMachine


CONFIGS = [
    (ps, comps) for ps in (1, 16) for comps in (("full",), ("full", "swa"), ("full", "recurrent"))
]


@pytest.mark.parametrize(
    ("page_size", "components"), CONFIGS, ids=[f"ps{p}-{'+'.join(c)}" for p, c in CONFIGS]
)
def test_tree_against_reference(page_size: int, components: tuple[str, ...]) -> None:
    machine = make_machine(page_size, components)
    machine.TestCase.settings = settings(
        max_examples=30,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase().runTest()
