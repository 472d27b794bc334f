"""What ``Engine.stats()`` reads of the loop, the scheduler and the graphs (the run's counters,
the cache and the pools in one flat dict), and ``Engine.check_invariants()``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyloop.framework.pipeline import StepPipeline
    from hyloop.framework.scheduler import Scheduler
    from hyloop.framework.stats import StepRecorder
    from hyloop.graphs.capture import Graphs


def engine_stats(
    recorder: StepRecorder, scheduler: Scheduler, graphs: Graphs, overlap: bool
) -> dict[str, Any]:
    """Step times and counts (``overlap``: with the lookahead loop's), cache hits, the graphs'
    counters, pool use; the engine adds its own request counts."""
    d = recorder.as_dict(overlap=overlap)
    kv = scheduler.cache.kv
    d.update(cached_tokens=scheduler.cached_tokens, reused_tokens=scheduler.reused_tokens)
    reuse = scheduler.cache.reuse
    selective = reuse.selective if reuse is not None else None
    d["recomputed_tokens"] = selective.recomputed if selective is not None else 0
    d.update(graphs.stats())
    free = kv.available_size()
    d.update(kv_free_tokens=free, kv_capacity_tokens=kv.capacity)
    d["kv_full_tokens_used"] = kv.capacity - free
    windows = scheduler.cache.windows
    d["kv_swa_tokens_used"] = windows.used_tokens() if windows is not None else 0
    d["cache_evictable_tokens"] = scheduler.cache.tree.evictable_size()
    return d


def check_engine(pipeline: StepPipeline, scheduler: Scheduler) -> None:
    """Ledger: free + pending-free + request-held + tree-held == capacity, for KV pages and
    state slots; tree structure, lock receipts and LRU order consistent; nothing a launched
    step reads is free."""
    pipeline.check_unresolved()
    scheduler.check(track_held=pipeline.held_track_slots())
