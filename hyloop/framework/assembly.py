"""Assembly: config + checkpoint -> model, pools, cache, runner. Derived values live here only."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyloop.cache import NoReuseCache, PrefixCache, UnifiedRadixCache
from hyloop.framework.config import EngineConfig
from hyloop.framework.frame_step import FrameRunner
from hyloop.framework.model_runner import ModelRunner, usable_buckets
from hyloop.framework.position_independent import PositionIndependentReuse
from hyloop.framework.swa_windows import SWAWindows
from hyloop.graphs.auto_plan import Estimates
from hyloop.graphs.buckets import ArtifactKey
from hyloop.graphs.history import StepHistory, history_key
from hyloop.models.kv_shift import shifter_for
from hyloop.models.layers import cpu_ops
from hyloop.models.layers.kernel_choice import cache_dir, calibrate, machine_key, shape_key
from hyloop.models.layers.packed_linear import PackedLinear, pack_linears, packing_available
from hyloop.models.loader import LoadedModel, load_model
from hyloop.models.tokenizer import TextTokenizer
from hyloop.pools import KVPool, RecurrentPool, ReqToTokenPool, StepFence, SWAKVPool

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_CONTEXT = 8192


@dataclass
class EngineParts:
    config: EngineConfig
    model: nn.Module
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    cache: PrefixCache
    runner: ModelRunner
    fence: StepFence  # the deferred-free rule every pool follows
    recurrent_pool: RecurrentPool | None
    track_interval: int | None
    tokenizer: TextTokenizer | None
    eos_token_ids: list[int]
    vocab_size: int
    max_context: int
    max_running: int
    row_channels: int  # channels of a multi-channel row model; 0: a token model
    end_id: int  # the end row's channel-0 id (row models; -1 for token models)
    channel_vocab_sizes: list[int]  # per channel (row models only)
    weight_bytes: int
    derived: dict[str, Any]
    pi_reuse: PositionIndependentReuse | None = None  # cache.position_independent
    swa_window: int | None = None  # sliding window of the layers in kv_pool.swa, if any


def resolve_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine")
    return dev


def use_compile_cache() -> Path:
    """Inductor's on-disk caches (FX graphs, AOT autograd, compiled kernels) under hyloop's
    cache directory, so ``$HYLOOP_CACHE_DIR`` holds everything a later run reuses; a
    ``TORCHINDUCTOR_CACHE_DIR`` the user set wins. Call before the first compile."""
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor")))


def build_parts(cfg: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    device = resolve_device(cfg.device)
    if cfg.graphs.backend != "eager":
        use_compile_cache()
    dtype = DTYPES[cfg.dtype]
    if loaded is None:
        if not cfg.model.path:
            raise ValueError("model.path: no checkpoint given")
        loaded = load_model(cfg.model.path, dtype, device)
    model = loaded.model
    packed, kernels = 0, None
    if cfg.model.cpu_packed_linear and packing_available(device):
        packed = pack_linears(model)
        if cfg.model.cpu_kernels == "measure":
            kernels = choose_kernels(cfg, model)
    native = device.type == "cpu" and cfg.model.cpu_ops is not False
    if native and cpu_ops.ensure_loaded(build=cfg.model.cpu_ops is True):
        cpu_ops.use_native(model)
    spec = model.spec
    swa_layers = 0
    if getattr(model, "sliding_layers", ()):
        _, swa_layers = model.place_kv_layers(cfg.kv_pool.swa_pool)
    model_limit = int(getattr(spec, "max_positions", DEFAULT_MAX_CONTEXT))
    max_context = cfg.model.max_context or min(model_limit, DEFAULT_MAX_CONTEXT)
    if max_context > model_limit:
        raise ValueError(
            f"model.max_context={max_context} exceeds the model's position limit {model_limit}"
        )
    page_size = cfg.kv_pool.page_size
    max_running = cfg.scheduler.max_running_requests
    budget = int(cfg.kv_pool.memory_budget_mb * 2**20)
    swa_window = int(model.sliding_window) if swa_layers else None
    swa_pages = 0
    if swa_window is not None:
        swa_pages = window_pool_pages(cfg, swa_window, swa_layers, model, dtype)
        swa_token = KVPool.bytes_per_token(swa_layers, model.kv_heads, model.head_dim, dtype)
        budget -= swa_pages * page_size * swa_token
    per_token = KVPool.bytes_per_token(model.num_kv_layers, model.kv_heads, model.head_dim, dtype)
    num_pages = cfg.kv_pool.num_pages
    if num_pages is None:
        num_pages = max(2, budget // (per_token * page_size))
    fence = StepFence()
    kv = KVPool(
        model.num_kv_layers,
        num_pages,
        page_size,
        model.kv_heads,
        model.head_dim,
        dtype,
        device,
        fence,
    )
    if swa_window is not None:
        kv.swa = SWAKVPool(
            swa_layers,
            swa_pages,
            page_size,
            model.kv_heads,
            model.head_dim,
            kv.num_slots,
            swa_window,
            dtype,
            device,
            fence,
        )
    req_to_token = ReqToTokenPool(max_running, max_context, device, fence)
    vocab_size = int(getattr(model, "max_vocab", spec.vocab_size))
    recurrent, track_interval = None, None
    if getattr(model, "num_recurrent_layers", 0):
        slots = cfg.recurrent_pool.num_slots or max(4 * max_running, 16)
        recurrent = model.new_recurrent_pool(slots, device, fence=fence)
        track_interval = cfg.recurrent_pool.track_interval or cfg.scheduler.prefill_chunk
        if track_interval % page_size:
            raise ValueError(
                f"recurrent_pool.track_interval defaults to scheduler.prefill_chunk="
                f"{cfg.scheduler.prefill_chunk}, which is not a multiple of kv_pool.page_size="
                f"{page_size}; set recurrent_pool.track_interval"
            )
    cache = build_cache(cfg, kv, recurrent)
    pi_reuse = None
    if cfg.cache.position_independent.enable:
        # Refuses, naming why, models whose KV cannot move (recurrent, sliding window).
        shifter = shifter_for(model)
        assert isinstance(cache, UnifiedRadixCache)
        pi_reuse = PositionIndependentReuse(cache, kv, shifter, cfg.cache.position_independent)
    row_channels = int(model.num_channels) if getattr(model, "is_row_model", False) else 0
    end_id = int(model.end_id) if row_channels else -1
    eos_ids = list(loaded.eos_token_ids)
    if row_channels and end_id not in eos_ids:
        eos_ids.append(end_id)  # a row model's end row stops it
    kind = FrameRunner if hasattr(model, "decode_frame") else ModelRunner
    runner = kind(model, kv, req_to_token, vocab_size, device, recurrent, cfg.graphs, row_channels)
    runner.attach_history(
        step_history(cfg, kind.__name__),
        Estimates.defaults(
            device=device.type,
            weight_bytes=loaded.weight_bytes,
            num_layers=max(1, model.num_kv_layers),
            compile_in_graph=cfg.graphs.compile_in_graph,
        ),
    )
    if runner.auto and kernels is not None:
        runner.before_capture = lambda keys: gemv_for_one_row(model, keys)
    derived = {
        "max_context": max_context,
        "kv_pages": num_pages,
        "kv_tokens": (num_pages - 1) * page_size,
        "kv_bytes": kv.nbytes(),
        "swa_window": swa_window,
        "swa_pages": kv.swa.allocator.num_pages if kv.swa is not None else 0,
        "swa_bytes": kv.swa.nbytes() if kv.swa is not None else 0,
        "cache": type(cache).__name__,
        "backend": runner.backend,
        "step": type(runner).__name__,
        "max_running": max_running,
        "row_channels": row_channels,
        "packed_linears": packed,
        "cpu_kernels": kernels,
        "recurrent_slots": recurrent.num_slots if recurrent is not None else 0,
        "recurrent_bytes": recurrent.nbytes() if recurrent is not None else 0,
        "track_interval": track_interval,
        "weight_bytes": loaded.weight_bytes,
    }
    log.info("hyloop assembly: %s", derived)
    return EngineParts(
        config=cfg,
        model=model,
        kv_pool=kv,
        req_to_token=req_to_token,
        cache=cache,
        runner=runner,
        fence=fence,
        recurrent_pool=recurrent,
        track_interval=track_interval,
        tokenizer=loaded.tokenizer,
        eos_token_ids=eos_ids,
        vocab_size=vocab_size,
        max_context=max_context,
        max_running=max_running,
        row_channels=row_channels,
        end_id=end_id,
        channel_vocab_sizes=list(model.channel_vocab_sizes) if row_channels else [],
        weight_bytes=loaded.weight_bytes,
        derived=derived,
        pi_reuse=pi_reuse,
        swa_window=swa_window,
    )


def window_pool_pages(
    cfg: EngineConfig, window: int, layers: int, model: nn.Module, dtype: torch.dtype
) -> int:
    """Pages of the sliding-window pool: ``kv_pool.swa_num_pages``, else two windows per
    running request (the tree keeps windows too) within half the KV memory budget, and never
    less than one request's window."""
    ps = cfg.kv_pool.page_size
    per_request = SWAWindows.worst_case_pages(window, cfg.scheduler.prefill_chunk, ps)
    pages = cfg.kv_pool.swa_num_pages
    if pages is None:
        per_token = KVPool.bytes_per_token(layers, model.kv_heads, model.head_dim, dtype)
        half_budget = int(cfg.kv_pool.memory_budget_mb * 2**20) // 2 // (per_token * ps)
        wanted = 2 * cfg.scheduler.max_running_requests * per_request
        pages = max(per_request, min(wanted, half_budget)) + 1
    if pages - 1 < per_request:
        raise ValueError(
            f"kv_pool.swa_num_pages={pages} cannot hold one request's window ({per_request} "
            f"pages of sliding window {window} + scheduler.prefill_chunk); raise it"
        )
    return pages


def build_cache(
    cfg: EngineConfig, kv: KVPool, recurrent: RecurrentPool | None = None
) -> PrefixCache:
    """The UHRC with the components the model's layer types need (or a no-reuse stand-in)."""
    cls = UnifiedRadixCache if cfg.cache.enable else NoReuseCache
    if kv.swa is not None:
        return cls(
            kv_allocator=kv.allocator,
            page_size=kv.page_size,
            components=("full", "swa"),
            sliding_window=kv.swa.window,
            swa_allocator=kv.swa.allocator,
        )
    if recurrent is not None:
        return cls(
            kv_allocator=kv.allocator,
            page_size=kv.page_size,
            components=("full", "recurrent"),
            recurrent_allocator=recurrent.allocator,
        )
    return cls(kv_allocator=kv.allocator, page_size=kv.page_size, components=("full",))


def step_history(cfg: EngineConfig, kind: str) -> StepHistory:
    """This machine's measured step times for this model and step configuration."""
    path = Path(str(cfg.model.path))
    try:
        st = path.stat()
        ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        ident = str(path)
    g = cfg.graphs
    key = history_key(
        machine_key(),
        ident,
        kind,
        cfg.dtype,
        cfg.device,
        g.kv_len_bucket,
        g.compile_in_graph,
        sorted(g.compile_options.items()),
        cfg.model.cpu_packed_linear,
        cfg.model.cpu_kernels,
        cfg.model.cpu_ops is not False and cpu_ops.available(),
    )
    return StepHistory(cache_dir() / "steps" / f"{key}.json")


def gemv_for_one_row(model: nn.Module, keys: list[ArtifactKey]) -> None:
    """Before ``auto`` compiles a batch-1 artifact: time the compiled GEMV for one row too
    (assembly left it out, as an eager step cannot use it)."""
    if any(k.batch == 1 for k in keys):
        layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        calibrate(layers, [1], with_gemv=True)


def choose_kernels(cfg: EngineConfig, model: nn.Module) -> dict[str, Any]:
    """Time the GEMM candidates of every packed Linear shape at the row counts the decode step
    runs (one row and each batch bucket) unless this machine's table has them, and hand each
    layer its choices (``kernel_choice``). What it chose goes into the run summary."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    buckets = usable_buckets(list(cfg.graphs.buckets), cfg.scheduler.max_running_requests)
    # ``auto`` starts eager; it times the GEMV if and when it compiles a batch-1 step.
    compiled = cfg.graphs.backend == "compile"
    table = calibrate(layers, [1, *buckets], with_gemv=compiled)
    chosen = {shape_key(m.weight): dict(m.kernels) for m in layers}
    return {"measured": table.measured, "measure_s": round(table.measure_s, 2), "choices": chosen}
