"""The KV pools of an engine, sized from the config and the model contract: the full pool
for every layer that does not keep a pool of its own, and the sliding-window layers' pool
(``kv_pool.swa_pool``) of the contract's window."""

from __future__ import annotations

import logging

import torch

from hyloop.framework.config import EngineConfig
from hyloop.models.contract import ModelContract, place_kv_layers
from hyloop.pools import KVPool, StepFence, SWAKVPool, SWAWindows

log = logging.getLogger(__name__)
_MB = 2**20


def kv_pools(
    cfg: EngineConfig,
    contract: ModelContract,
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    fence: StepFence,
) -> KVPool:
    """The KV pool, sized from ``kv_pool.num_pages`` or the memory budget, with the sliding-
    window layers' pool of its own (``kv_pool.swa_pool``) when the model has such layers."""
    window = contract.sliding_window
    own_pool = cfg.kv_pool.swa_pool and window is not None
    full_layers, swa_layers = place_kv_layers(model, contract.kv_windows, own_pool)
    ps, max_running = cfg.kv_pool.page_size, cfg.scheduler.max_running_requests
    heads, dim = contract.kv_heads, contract.head_dim
    budget = kv_budget_bytes(
        cfg.kv_pool.memory_budget_mb, cfg.kv_pool.gpu_memory_utilization, device
    )
    swa_pages = 0
    if swa_layers:
        assert window is not None
        per_token = KVPool.bytes_per_token(swa_layers, heads, dim, dtype)
        chunk = cfg.scheduler.prefill_chunk
        swa_pages = cfg.kv_pool.swa_num_pages or SWAWindows.pool_pages(
            window,
            chunk,
            ps,
            per_request_pools=2 * max_running,
            budget_pages=budget // 2 // (per_token * ps),
        )
        SWAWindows.check_pool(swa_pages, window, chunk, ps)
        budget -= swa_pages * ps * per_token
    num_pages = cfg.kv_pool.num_pages
    if num_pages is None:
        num_pages = max(2, budget // (KVPool.bytes_per_token(full_layers, heads, dim, dtype) * ps))
    kv = KVPool(full_layers, num_pages, ps, heads, dim, dtype, device, fence)
    if swa_layers:
        assert window is not None
        kv.swa = SWAKVPool(
            swa_layers, swa_pages, ps, heads, dim, kv.num_slots, window, dtype, device, fence
        )
    return kv


def kv_budget_bytes(
    memory_budget_mb: float, utilization: float | None, device: torch.device | str
) -> int:
    """The KV pool's byte budget: ``kv_pool.memory_budget_mb``, or on CUDA with
    ``kv_pool.gpu_memory_utilization`` set, that share of the device's memory less what is
    already in use (weights loaded) and a 5% reserve for activations and graph pools."""
    dev = torch.device(device)
    if utilization is None:
        return int(memory_budget_mb * _MB)
    if dev.type != "cuda":
        log.info("gpu_memory_utilization=%s has no effect on %s", utilization, dev)
        return int(memory_budget_mb * _MB)
    free, total = torch.cuda.mem_get_info(dev)
    budget = int(utilization * total) - (total - free) - total // 20
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization}: {(total - free) / _MB:.0f} MiB of "
            f"{total / _MB:.0f} MiB are in use already; no room for the KV pool"
        )
    return budget
