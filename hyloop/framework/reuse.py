"""Position-independent reuse for the engine: the donor index, the planner and the K shift.

Admission asks for a plan after the exact-prefix match, locks each reused run's donor, makes
room, allocates the request's pages and realises the plan into them (V copied, K rotated by the
position delta); then releases the donors. Commits record what the tree now holds, so later
prompts can reuse it. The cache side (``hyloop.cache.position_independent``) knows nothing of
RoPE; the shift (``hyloop.models.kv_shift``) knows nothing of the tree.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

from hyloop.cache import InsertResult, RadixKey, UnifiedRadixCache
from hyloop.cache.position_independent.chunker import Chunker, ChunkerParams
from hyloop.cache.position_independent.index import DonorIndex
from hyloop.cache.position_independent.planner import ReusePlan, ReusePlanner
from hyloop.framework.config import PositionIndependentSection
from hyloop.framework.requests import Request
from hyloop.models.kv_shift import KVShifter
from hyloop.pools import KVPool


class PositionIndependentReuse:
    def __init__(
        self,
        cache: UnifiedRadixCache,
        kv: KVPool,
        shifter: KVShifter,
        section: PositionIndependentSection,
        force_collisions: bool = False,
    ) -> None:
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
        self.index = DonorIndex(Chunker(params), force_collisions=force_collisions)
        cache.delete_listeners.append(self.index.on_node_deleted)
        self.planner = ReusePlanner(self.index, kv.page_size, section.recompute_tokens)
        self.kv = kv
        self.shifter = shifter

    def note(self, req: Request, key: RadixKey, r: InsertResult) -> None:
        """``req`` committed ``key``; the tree now holds its first ``r.aligned_len`` tokens."""
        rows = None
        if req.prompt_rows is not None:  # row models: full rows confirm a hit
            rows = _rows(req)[: r.aligned_len]
        self.index.note(key, r.aligned_len, r.last_node, r.prefix_len, rows)

    def plan(self, req: Request, cached: int, extra_key: Hashable = None) -> ReusePlan:
        """Reuse for the prompt positions before the last (whose logits the prefill needs)."""
        n = len(req.prompt_ids) - 1
        rows = req.prompt_rows[:n].numpy() if req.prompt_rows is not None else None
        return self.planner.plan(req.prompt_ids[:n], cached, extra_key, rows)

    def realise(self, plan: ReusePlan, slots: torch.Tensor) -> None:
        """Write every reused run into ``slots`` (the request's own pages at those positions)."""
        runs = plan.reused
        if not runs:
            return
        src = torch.cat([r.src_slots for r in runs if r.src_slots is not None])
        dst = torch.cat([slots[r.start : r.end] for r in runs])
        new_pos = torch.cat([torch.arange(r.start, r.end) for r in runs])
        old_pos = torch.cat([torch.arange(r.src_start, r.src_start + r.length) for r in runs])
        self.shifter.copy_shifted(self.kv.k, self.kv.v, src, dst, old_pos, new_pos)

    def check(self) -> None:
        self.index.check()


def _rows(req: Request) -> np.ndarray:
    assert req.prompt_rows is not None and req.output_rows is not None
    prompt = req.prompt_rows.numpy()
    if not req.output_rows:
        return prompt
    out = np.asarray(req.output_rows, dtype=np.int64).reshape(-1, prompt.shape[1])
    return np.concatenate([prompt, out])
