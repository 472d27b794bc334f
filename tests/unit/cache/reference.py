"""A plain-Python reference model of the UHRC's observable state, for the property tests.

It records, per namespace, every page-aligned token prefix the tree holds, the KV slots of the
prefix's last page, whether that page carries SWA data and whether a recurrent snapshot ends
there. It knows
nothing of nodes, splits or LRU: hits are recomputed from these facts by brute force.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

Prefix = tuple[Any, tuple[int, ...]]  # (extra_key, tokens)


@dataclass
class Entry:
    slots: list[int]
    swa: bool = True
    rec: bool = False


@dataclass
class ReferenceCache:
    page_size: int
    window: int | None = None  # SWA window, None without SWA
    recurrent: bool = False
    prefixes: dict[Prefix, Entry] = field(default_factory=dict)

    def full_match(self, ns: Any, tokens: tuple[int, ...]) -> int:
        best = 0
        for length in range(self.page_size, len(tokens) + 1, self.page_size):
            if (ns, tokens[:length]) not in self.prefixes:
                break
            best = length
        return best

    def hit(self, ns: Any, tokens: tuple[int, ...], full_only: bool = False) -> int:
        ps = self.page_size
        full = self.full_match(ns, tokens)
        if full_only:
            return full
        for length in range(full, 0, -ps):
            if self.recurrent and not self.prefixes[(ns, tokens[:length])].rec:
                continue
            if self.window is not None:
                lo = max(0, length - self.window)
                # The page holding token p ends at the next page multiple.
                ends = {(p // ps + 1) * ps for p in range(lo, length)}
                if not all(self.prefixes[(ns, tokens[:end])].swa for end in ends):
                    continue
            return length
        return 0

    def slots(self, ns: Any, tokens: tuple[int, ...], length: int) -> list[int]:
        out: list[int] = []
        for end in range(self.page_size, length + 1, self.page_size):
            out += self.prefixes[(ns, tokens[:end])].slots
        return out

    def insert(
        self, ns: Any, tokens: tuple[int, ...], slots: list[int], with_snapshot: bool
    ) -> int:
        """Record an insert; returns the prefix the tree already held."""
        ps = self.page_size
        aligned = len(tokens) - len(tokens) % ps
        held = self.full_match(ns, tokens)
        for end in range(ps, aligned + 1, ps):
            key = (ns, tokens[:end])
            if key in self.prefixes:
                self.prefixes[key].swa = True
            else:
                self.prefixes[key] = Entry(slots=slots[end - ps : end])
        if with_snapshot and aligned == len(tokens) and aligned:
            self.prefixes[(ns, tokens)].rec = True
        return held


def tree_prefixes(cache: Any) -> dict[Prefix, tuple[list[int], bool, bool]]:
    """Walk the tree's nodes: every page-aligned prefix it holds -> (slots of its last page,
    has SWA, snapshot ends here)."""
    ps = cache.page_size
    out: dict[Prefix, tuple[list[int], bool, bool]] = {}
    stack = [(child, ck[0], ()) for ck, child in cache.root.children.items()]
    while stack:
        node, ns, before = stack.pop()
        tokens = tuple(array("q", node.key))
        slots = node.component_data[0].value.tolist()
        swa = node.component_data[1].value is not None
        rec = node.component_data[2].value is not None
        for end in range(ps, len(tokens) + 1, ps):
            full = before + tokens[:end]
            out[(ns, full)] = (slots[end - ps : end], swa, rec and end == len(tokens))
        stack.extend((c, ns, before + tokens) for c in node.children.values())
    return out
