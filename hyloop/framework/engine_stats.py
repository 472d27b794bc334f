"""``Engine.stats()`` (the run's counters, the cache and the pools in one flat dict) and
``Engine.check_invariants()``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hyloop.framework.engine import Engine
    from hyloop.framework.pipeline import StepPipeline
    from hyloop.framework.scheduler import Scheduler


def engine_stats(engine: Engine, overlap: bool) -> dict[str, Any]:
    """Step times and counts (``overlap``: with the lookahead loop's), cache hits, requests
    finished, the graphs' counters, pool use."""
    d = engine.recorder.as_dict(overlap=overlap)
    sched = engine.scheduler
    kv = sched.cache.kv
    d.update(cached_tokens=sched.cached_tokens, reused_tokens=sched.reused_tokens)
    selective = sched.cache.reuse.selective if sched.cache.reuse is not None else None
    d["recomputed_tokens"] = selective.recomputed if selective is not None else 0
    d.update(requests_finished=engine.finished, requests_aborted=engine.aborted)
    d["requests_failed"] = engine.failed
    d.update(engine.graphs.stats())
    d.update(lookahead=engine.lookahead_enabled, weight_bytes=engine.derived.weight_bytes)
    d["numerics"] = engine.derived.numerics  # what the Linears compute (config-named)
    free = kv.available_size()
    d.update(kv_free_tokens=free, kv_capacity_tokens=kv.capacity)
    d["kv_full_tokens_used"] = kv.capacity - free
    windows = sched.cache.windows
    d["kv_swa_tokens_used"] = windows.used_tokens() if windows is not None else 0
    d["cache_evictable_tokens"] = sched.cache.tree.evictable_size()
    return d


def check_engine(pipeline: StepPipeline, scheduler: Scheduler) -> None:
    """Ledger: free + pending-free + request-held + tree-held == capacity, for KV pages and
    state slots; tree structure, lock receipts and LRU order consistent; nothing a launched
    step reads is free."""
    pipeline.check_unresolved()
    scheduler.check(track_held=pipeline.held_track_slots())
