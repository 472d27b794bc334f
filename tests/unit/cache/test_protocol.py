"""The cache package's boundaries: the no-reuse cache is the UHRC in another mode (the same
caller bookkeeping), and components reach the tree only through its ``ComponentHost`` surface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import hyloop.cache
from hyloop.cache import (
    EvictParams,
    IncLockRefResult,
    InsertParams,
    MatchPrefixParams,
    NoReuseCache,
    RadixKey,
    UnifiedRadixCache,
)
from hyloop.cache.component_base import CacheComponent, ComponentHost
from hyloop.pools import PageAllocator, SlotAllocator

Setup = tuple[UnifiedRadixCache, PageAllocator, SlotAllocator | None]
_KINDS = ("full", "swa", "recurrent")


def make(cls: type, kind: str) -> Setup:
    alloc = PageAllocator(num_pages=64, page_size=1)
    if kind == "full":
        return cls(kv_allocator=alloc), alloc, None
    if kind == "swa":
        return cls(kv_allocator=alloc, components=("full", "swa"), sliding_window=4), alloc, None
    slots = SlotAllocator(8)
    cache = cls(kv_allocator=alloc, components=("full", "recurrent"), recurrent_allocator=slots)
    return cache, alloc, slots


_SETUPS = [(cls, kind) for cls in (UnifiedRadixCache, NoReuseCache) for kind in _KINDS]
_IDS = [f"{cls.__name__}-{kind}" for cls, kind in _SETUPS]


@pytest.mark.parametrize(("cls", "kind"), _SETUPS, ids=_IDS)
def test_both_caches_are_the_uhrc(cls: type, kind: str) -> None:
    cache = make(cls, kind)[0]
    assert isinstance(cache, UnifiedRadixCache)
    assert cache.reuses_prefixes is (cls is UnifiedRadixCache)


def _methods(cls: type) -> list[str]:
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]


def serve(setup: Setup, prompt: list[int]) -> int:
    """One request as the engine drives it, through the protocol alone; returns the hit length.

    The caller's bookkeeping is the same for both caches: after the insert the request holds
    only its unaligned tail (none here, page_size 1) and the state slot the cache did not take,
    and the ledgers balance at every step.
    """
    cache, alloc, slots = setup
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    lock = cache.inc_lock_ref(m.last_node)
    new = alloc.alloc(len(prompt) - m.prefix_len)
    assert new is not None
    slot = None
    if slots is not None:
        got = slots.alloc(1)
        assert got is not None
        slot = int(got[0])
    row = torch.cat([m.device_indices, new])
    cache.check_invariants(request_held_tokens=len(new), request_held_slots=int(slot is not None))
    r = cache.insert(InsertParams(key=RadixKey(prompt), value=row, recurrent_slot=slot))
    assert r.aligned_len == len(prompt) and r.num_freed == (0 if cache.reuses_prefixes else 6)
    if slot is not None and not r.recurrent_taken:
        assert slots is not None
        slots.free([slot])
    relock = cache.inc_lock_ref(r.last_node)
    cache.dec_lock_ref(lock.to_dec_params())
    cache.check_invariants()
    cache.dec_lock_ref(relock)
    assert cache.num_outstanding_locks() == 0
    return m.prefix_len


@pytest.mark.parametrize(("cls", "kind"), _SETUPS, ids=_IDS)
def test_callers_need_no_concrete_class(cls: type, kind: str) -> None:
    setup = make(cls, kind)
    cache, alloc, slots = setup
    assert serve(setup, [1, 2, 3, 4, 5, 6]) == 0
    assert serve(setup, [1, 2, 3, 4, 5, 6]) == (6 if cache.reuses_prefixes else 0)
    cache.evict(EvictParams(num_tokens=alloc.capacity, recurrent_num=8))
    assert alloc.available_size() == alloc.capacity
    assert slots is None or slots.available_size() == slots.capacity
    cache.check_invariants()


def test_no_reuse_insert_frees_exactly_the_aligned_part() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4)
    cache = NoReuseCache(kv_allocator=alloc, page_size=4)
    value = alloc.alloc(6)  # two pages
    assert value is not None
    before = alloc.available_size()
    r = cache.insert(InsertParams(key=RadixKey([9, 8, 7, 6, 5, 4]), value=value[:6]))
    assert (r.prefix_len, r.aligned_len, r.num_freed, r.last_node) == (0, 4, 4, cache.root)
    assert alloc.available_size() == before + 4
    pages = (value[[0, 4]] // 4).numpy()
    assert alloc.is_free_page(pages).tolist() == [True, False]  # the tail page stays the caller's
    cache.check_invariants(request_held_tokens=4)
    assert cache.peek_prefix_len(RadixKey([9, 8, 7, 6])) == 0


# -- components touch only the tree's component surface ----------------------------------------

_COMPONENT_FILES = sorted(Path(hyloop.cache.__file__).parent.glob("component_*.py"))
_HOST_MEMBERS = set(ComponentHost.__annotations__) | set(_methods(ComponentHost))


def tree_attributes(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each attribute a component reads on the tree: ``cache.x``,
    ``tree.x``, ``self.cache.x``, or ``x`` on a local bound to ``self.cache``."""
    tree = ast.parse(source)

    def is_self_cache(e: ast.expr) -> bool:
        return (
            isinstance(e, ast.Attribute)
            and e.attr in ("cache", "tree")
            and isinstance(e.value, ast.Name)
            and e.value.id == "self"
        )

    aliases = {"cache", "tree"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and is_self_cache(node.value):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id in aliases) or is_self_cache(base):
                found.append((node.lineno, node.attr))
    return found


def test_the_check_catches_private_access() -> None:
    """What the components did before the tree had a component surface."""
    old = (
        "def evict(self, amount):\n"
        "    cache = self.cache\n"
        "    cache._delete_leaf(node)\n"
        "    if cache._tombstone(node, self):\n"
        "        self.cache._kv_to_free.append(cd.value)\n"
        "    t = self.cache\n"
        "    t._slots_to_free.append(slot)\n"
    )
    found = {name for _, name in tree_attributes(old)}
    assert found == {"_delete_leaf", "_tombstone", "_kv_to_free", "_slots_to_free"}


@pytest.mark.parametrize("path", _COMPONENT_FILES, ids=lambda p: p.name)
def test_components_use_only_the_host_surface(path: Path) -> None:
    used = tree_attributes(path.read_text())
    private = [(line, name) for line, name in used if name.startswith("_")]
    assert not private, f"{path.name} reaches into the tree's privates at {private}"
    outside = [(line, name) for line, name in used if name not in _HOST_MEMBERS]
    assert not outside, f"{path.name} uses {outside}, not declared on ComponentHost"


def test_the_tree_is_the_host_its_components_expect() -> None:
    assert len(_COMPONENT_FILES) == 4 and {"delete_leaf", "tombstone"} <= _HOST_MEMBERS
    cache = UnifiedRadixCache(
        kv_allocator=PageAllocator(16, 1), components=("full", "swa"), sliding_window=2
    )
    for name in _HOST_MEMBERS:
        assert hasattr(cache, name), name
    assert "drop" in vars(CacheComponent)  # the tombstone cascade calls a declared hook


# -- receipts name what each component locked ---------------------------------------------------


def put(setup: Setup, tokens: list[int], with_slot: bool = False) -> None:
    cache, alloc, slots = setup
    value = alloc.alloc(len(tokens))
    assert value is not None
    slot = None
    if with_slot:
        assert slots is not None
        got = slots.alloc(1)
        assert got is not None
        slot = int(got[0])
    cache.insert(InsertParams(key=RadixKey(tokens), value=value, recurrent_slot=slot))


def lock(setup: Setup, tokens: list[int]) -> IncLockRefResult:
    cache = setup[0]
    return cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_node)


def test_receipt_fields_come_from_the_right_component() -> None:
    full = make(UnifiedRadixCache, "full")
    put(full, [1, 2, 3])
    r = lock(full, [1, 2, 3])
    assert (r.delta, r.swa_start_depth, r.recurrent_locked) == (3, None, False)

    swa = make(UnifiedRadixCache, "swa")  # window 4
    put(swa, list(range(1, 7)))
    put(swa, list(range(1, 11)))
    r = lock(swa, list(range(1, 11)))  # the window is the 4-token leaf [6, 10) alone
    assert (r.delta, r.swa_start_depth, r.recurrent_locked) == (10, 6, False)
    swa[0].check_invariants()

    rec = make(UnifiedRadixCache, "recurrent")
    put(rec, [1, 2], with_slot=True)
    put(rec, [1, 2, 3, 4])
    r = lock(rec, [1, 2])
    assert (r.delta, r.swa_start_depth, r.recurrent_locked) == (2, None, True)
    assert rec[0].protected_size("recurrent") == 1
    rec[0].dec_lock_ref(r)
    leaf = rec[0].match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]), full_only=True))
    r = rec[0].inc_lock_ref(leaf.last_node)  # no snapshot at the leaf
    assert (r.delta, r.recurrent_locked) == (4, False)
    rec[0].check_invariants()
