"""The page allocator the cache frees into, against a plain set of free pages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyloop.pools import PageAllocator


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 99)), max_size=40),
)
def test_alloc_free_match_a_set_model(page_size: int, ops: list[tuple[bool, int, int]]) -> None:
    alloc = PageAllocator(num_pages=9, page_size=page_size)
    free = set(range(1, 9))
    held: list[torch.Tensor] = []
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            got = alloc.alloc(n)
            need = -(-n // page_size)
            if need > len(free):
                assert got is None
                continue
            assert got is not None and got.numel() == need * page_size
            pages = set((got // page_size).tolist())
            assert len(pages) == need and pages <= free
            free -= pages
            held.append(got)
        else:
            got = held.pop(pick % len(held))
            alloc.free(got.flip(0) if pick % 2 else got)  # any order of one owner's slots
            free |= set((got // page_size).tolist())
            with pytest.raises(ValueError, match="double free"):
                alloc.free(got)
        assert alloc.free_page_ids() == free
        assert alloc.available_size() == len(free) * page_size
        alloc.check_invariants()


def test_bad_frees_raise_and_change_nothing() -> None:
    alloc = PageAllocator(num_pages=8, page_size=1)
    got = alloc.alloc(3)
    before = alloc.free_page_ids()
    for bad in ([0], [-1], [8], [int(got[0]), int(got[0])]):
        with pytest.raises(ValueError, match="page"):
            alloc.free(torch.tensor(bad))
        assert alloc.free_page_ids() == before
    alloc.check_invariants()
