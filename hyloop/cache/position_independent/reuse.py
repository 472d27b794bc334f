"""Position-independent reuse for the engine: the donor index, the planner and the K shift.

Admission asks for a plan after the exact-prefix match, locks each reused run's donor, makes
room, allocates the request's pages and realises the plan into them (V copied, K rotated by the
position delta); then releases the donors. Commits record what the tree now holds, so later
prompts can reuse it (the tree marks it approximate). The cache side
(``hyloop.cache.position_independent``) knows nothing of RoPE; the shift
(``hyloop.models.kv_shift``) knows nothing of the tree.

With ``recompute_ratio > 0`` (and a model whose contract has ``selective_recompute``) prefill runs
through the reused spans instead of skipping them: ``SelectiveRecompute.blend`` marks each
chunk's reused tokens and sizes how many go past the check layer (``models.blend``), and the
host counts exactly which share was recomputed without reading the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hyloop.cache import InsertResult, RadixKey, UnifiedRadixCache
from hyloop.cache.lease import Lease
from hyloop.cache.position_independent.chunker import Chunker, ChunkerParams
from hyloop.cache.position_independent.index import DonorIndex
from hyloop.cache.position_independent.planner import ReusePlan, ReusePlanner
from hyloop.graphs.step_batch import Blend
from hyloop.models.kv_shift import KVShifter
from hyloop.pools import KVPool

if TYPE_CHECKING:
    from hyloop.framework.config import PositionIndependentSection
    from hyloop.framework.requests import Chunk, Request


@dataclass
class SelectiveRecompute:
    """Of each prefill chunk's reused tokens, ``ratio`` (rounded up) run on past
    ``check_layer``: those whose K there deviates most from the donor's."""

    ratio: float
    check_layer: int
    recomputed: int = 0  # reused tokens computed again, all requests
    max_stretch: int = 8  # a chunk spans at most this many times the scheduler's chunk limit

    def cost(self, spans: list[tuple[int, int]], start: int, length: int) -> int:
        """Tokens of ``[start, start + length)`` that run every layer: the computed ones and
        ``ratio`` of the reused (the layers before the check layer, a small share of the
        model, run on all of them and are not counted)."""
        end = start + length
        reused = sum(max(0, min(e, end) - max(s, start)) for s, e in spans)
        return length - reused + math.ceil(self.ratio * reused)

    def fit(self, spans: list[tuple[int, int]], start: int, stop: int, limit: int) -> int:
        """The longest chunk from ``start`` (up to ``stop``) that costs at most ``limit``
        tokens: a selective request's prompt runs in one chunk where it can, so the attention
        that weighs its reused tokens is its query's (``models.blend``)."""
        lo = min(stop - start, limit)  # costs at most its length
        hi = min(stop - start, limit * self.max_stretch)
        while lo < hi:  # the cost grows with the length: the longest within the limit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cost(spans, start, mid) <= limit else (lo, mid - 1)
        return lo

    def blend(
        self,
        chunks: list[Chunk],
        width: int,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> Blend | None:
        """The ``Blend`` of a prefill step over ``chunks`` padded to ``width`` tokens (None:
        every token runs every layer); counts the reused tokens it recomputes, per request."""
        reused = torch.zeros(len(chunks), width, dtype=torch.bool)
        counts, need = [], []
        for i, c in enumerate(chunks):
            lease = c.req.lease
            spans = lease.blend_spans if lease is not None and lease.selective is self else []
            end = c.start + c.length
            for s, e in spans:
                if s < end and e > c.start:
                    reused[i, max(s, c.start) - c.start : min(e, end) - c.start] = True
            n = int(reused[i].sum())
            counts.append(n)
            need.append(c.length - n + math.ceil(self.ratio * n))
        keep = max(need)
        whole = keep >= width or not any(counts)  # every token runs every layer
        for c, n, m in zip(chunks, counts, need, strict=True):
            done = n if whole else m - (c.length - n)
            c.req.num_recomputed += done
            self.recomputed += done
        if whole:
            return None
        quota = torch.tensor(need, dtype=torch.int64)
        return Blend(to_device(reused), to_device(quota), keep, self.check_layer)


class PositionIndependentReuse:
    def __init__(
        self,
        cache: UnifiedRadixCache,
        kv: KVPool,
        shifter: KVShifter,
        section: PositionIndependentSection,
        selective_recompute: bool = False,
        force_collisions: bool = False,
    ) -> None:
        """``selective_recompute``: the model's forward can recompute part of reused KV
        (``ModelContract.selective_recompute``); without it only the fixed head is."""
        if "full" not in cache.component_names or len(cache.component_names) != 1:
            raise ValueError(
                f"cache.position_independent: the cache has components {cache.component_names}; "
                "reuse at a new offset is built for full-attention KV only"
            )
        params = ChunkerParams(
            window=section.window,
            boundary_bits=section.boundary_bits,
            min_chunk=section.min_chunk,
            max_chunk=section.max_chunk,
            sink_tokens=section.sink_tokens,
        )
        self.cache = cache
        self.index = DonorIndex(Chunker(params), force_collisions=force_collisions)
        cache.delete_listeners.append(self.index.on_node_deleted)
        self.planner = ReusePlanner(self.index, kv.page_size, section.recompute_tokens)
        self.kv = kv
        self.shifter = shifter
        self.selective: SelectiveRecompute | None = None
        if selective_recompute and section.recompute_ratio > 0:
            self.selective = SelectiveRecompute(section.recompute_ratio, section.check_layer)

    def note(self, req: Request, key: RadixKey, r: InsertResult) -> None:
        """``req`` committed ``key``; the tree now holds its first ``r.aligned_len`` tokens."""
        rows = None
        if req.prompt_rows is not None:  # row models: full rows confirm a hit
            rows = _rows(req)[: r.aligned_len]
        self.index.note(key, r.aligned_len, r.last_node, r.prefix_len, rows)

    def plan(self, req: Request, cached: int) -> ReusePlan | None:
        """Reuse for the prompt positions before the last (whose logits the prefill needs),
        from donors of the request's own namespace (``extra_key``) only, each donor locked
        until ``realise`` or ``drop`` (None: nothing to reuse)."""
        n = len(req.prompt_ids) - 1
        rows = req.prompt_rows[:n].numpy() if req.prompt_rows is not None else None
        plan = self.planner.plan(req.prompt_ids[:n], cached, req.extra_key, rows)
        if not plan.reused:
            return None
        plan.locks.extend(self.cache.inc_lock_ref(s.node) for s in plan.reused)
        return plan

    def drop(self, plan: ReusePlan) -> None:
        """Unlock the plan's donors (once)."""
        locks = list(plan.locks)
        plan.locks.clear()
        for lock in locks:
            self.cache.dec_lock_ref(lock)

    def realise(self, plan: ReusePlan, lease: Lease) -> None:
        """Write every reused run into ``lease.slots`` (the request's own pages at those
        positions), unlock the donors and record the runs on ``lease``."""
        runs, slots = plan.reused, lease.slots
        src = torch.cat([r.src_slots for r in runs if r.src_slots is not None])
        dst = torch.cat([slots[r.start : r.end] for r in runs])
        new_pos = torch.cat([torch.arange(r.start, r.end) for r in runs])
        old_pos = torch.cat([torch.arange(r.src_start, r.src_start + r.length) for r in runs])
        self.shifter.copy_shifted(self.kv.k, self.kv.v, src, dst, old_pos, new_pos)
        self.drop(plan)
        spans = [(r.start, r.end) for r in runs]
        if self.selective is None:
            lease.reused_spans = spans
        else:
            lease.blend_spans, lease.selective = spans, self.selective
        lease.reused = plan.reused_tokens
        lease.approximate_from = spans[0][0]  # reused KV, and all computed after it

    def check(self) -> None:
        self.index.check()


def _rows(req: Request) -> np.ndarray:
    assert req.prompt_rows is not None and req.output_rows is not None
    prompt = req.prompt_rows.numpy()
    if not req.output_rows:
        return prompt
    out = np.asarray(req.output_rows, dtype=np.int64).reshape(-1, prompt.shape[1])
    return np.concatenate([prompt, out])
