"""Assembly: config + checkpoint -> one ``Engine``. The only place the engine is wired, in
sections (model and its CPU kernels, pools, cache, step kind and graphs, scheduler and loops);
every derived value is computed here, once, and kept in ``Derived``."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hyloop.cache import UnifiedRadixCache
from hyloop.cache.lease import RequestCache
from hyloop.cache.position_independent.exactness import ApproximateKV
from hyloop.cache.position_independent.reuse import PositionIndependentReuse
from hyloop.cache.unified import build_cache
from hyloop.framework.config import EngineConfig
from hyloop.framework.engine import Engine
from hyloop.framework.kv_pools import kv_pools
from hyloop.framework.pipeline import StepPipeline
from hyloop.framework.scheduler import Scheduler
from hyloop.framework.stats import DeviceClock, StepRecorder
from hyloop.framework.step_kinds import StepKind
from hyloop.framework.token_step import TokenStep
from hyloop.graphs.capture import (
    BucketRunner,
    Estimates,
    Graphs,
    StepHistory,
    history_key,
    kv_len_buckets,
    resolve_backend,
    usable_buckets,
)
from hyloop.graphs.capture.buffer import CaptureBuffer
from hyloop.graphs.step_batch import StepPools
from hyloop.models.contract import ModelContract
from hyloop.models.cpu import CpuKernels, cpu_ops
from hyloop.models.cpu.kernel_choice import cache_dir, machine_key
from hyloop.models.kv_shift import shifter_for
from hyloop.models.layers.attention import compute_paths
from hyloop.models.loader import LoadedModel, generation_defaults, load_model, load_tokenizer
from hyloop.pools import RecurrentPool, ReqToTokenPool, StepFence, SWAWindows
from hyloop.speculative import speculator_for
from hyloop.utils.host_memory import trim_heap

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_CONTEXT = 8192


@dataclass(frozen=True)
class Derived:
    """What assembly derived from the config and the checkpoint (logged once)."""

    max_context: int
    max_running: int
    vocab_size: int
    kv_pages: int
    kv_tokens: int
    kv_bytes: int
    swa_window: int | None
    swa_pages: int
    swa_bytes: int
    recurrent_slots: int
    recurrent_bytes: int
    track_interval: int | None
    cache: str
    backend: str
    step: str
    row_channels: int  # channels of a multi-channel row model; 0: a token model
    end_id: int  # the end row's channel-0 id (row models; -1 for token models)
    channel_vocab_sizes: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, Any]  # SamplingParams fields of a request that gives none
    weight_bytes: int
    packed_linears: int
    quantized_linears: dict[str, int]  # model.weights: Linears per format (int4, int8, dense)
    cpu_kernels: dict[str, Any] | None
    numerics: str  # what the Linears compute (``CpuKernels.numerics``), in a line


def resolve_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine")
    return dev


def use_compile_cache() -> Path:
    """Inductor's on-disk caches under hyloop's cache directory, so ``$HYLOOP_CACHE_DIR`` holds
    everything a later run reuses; a ``TORCHINDUCTOR_CACHE_DIR`` the user set wins. Call
    before the first compile."""
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor")))


def build_engine(
    cfg: EngineConfig, loaded: LoadedModel | None = None, engine_type: type[Engine] = Engine
) -> Engine:
    # -- model and its CPU kernels --------------------------------------------------------------
    device = resolve_device(cfg.device)
    backend = resolve_backend(cfg.graphs.backend, device)
    if backend != "eager":
        use_compile_cache()
    dtype = DTYPES[cfg.dtype]
    if loaded is None:
        if not cfg.model.path:
            raise ValueError("model.path: no checkpoint given")
        loaded = load_model(cfg.model.path, dtype, device, cfg.model.weights)
    model, contract = loaded.model, loaded.model.contract
    max_running = cfg.scheduler.max_running_requests
    buckets = usable_buckets(cfg.graphs.buckets, max_running)
    cpu = None
    if device.type == "cpu":
        cpu = CpuKernels(
            model,
            pack=cfg.model.cpu_packed_linear,
            kernels=cfg.model.cpu_kernels,
            native=cfg.model.cpu_ops,
            stack=cfg.model.cpu_stack,
        )
    max_context = cfg.model.max_context or min(contract.max_positions, DEFAULT_MAX_CONTEXT)
    if max_context > contract.max_positions:
        raise ValueError(
            f"model.max_context={max_context} exceeds the model's position limit "
            f"{contract.max_positions}"
        )

    # -- pools ----------------------------------------------------------------------------------
    fence = StepFence()
    kv = kv_pools(cfg, contract, model, dtype, device, fence)
    req_to_token = ReqToTokenPool(max_running, max_context, device, fence)
    recurrent, track_interval = None, None
    if contract.recurrent is not None:
        r = contract.recurrent
        slots = cfg.recurrent_pool.num_slots or max(4 * max_running, 16)
        shape = (r.num_layers, slots, r.temporal_shape, r.conv_dim, r.conv_kernel)
        recurrent = RecurrentPool(*shape, device=device, fence=fence)
        track_interval = cfg.recurrent_pool.track_interval or cfg.scheduler.prefill_chunk
        if track_interval % kv.page_size:
            raise ValueError(
                f"recurrent_pool.track_interval defaults to scheduler.prefill_chunk="
                f"{cfg.scheduler.prefill_chunk}, which is not a multiple of kv_pool.page_size="
                f"{kv.page_size}; set recurrent_pool.track_interval"
            )

    # -- cache ----------------------------------------------------------------------------------
    # A window lock pins nodes of at most a prefill chunk (``SWAComponent.lock_cuts``).
    granule = max(kv.page_size, cfg.scheduler.prefill_chunk // kv.page_size * kv.page_size)
    pi = cfg.cache.position_independent
    marks = [ApproximateKV(kv.page_size)] if pi.enable else []  # reused KV is marked as such
    tree = build_cache(cfg.cache.enable, kv, recurrent, contract.sliding_window, granule, marks)
    reuse = None
    if pi.enable:
        # Refuses, naming why, models whose KV cannot move (recurrent, sliding window).
        shifter = shifter_for(contract, type(model).__name__)
        assert isinstance(tree, UnifiedRadixCache)
        reuse = PositionIndependentReuse(tree, kv, shifter, pi, contract.selective_recompute)
    windows = SWAWindows(kv.swa, cfg.scheduler.prefill_chunk) if kv.swa is not None else None
    cache = RequestCache(
        tree, kv.allocator, req_to_token, recurrent, max_context, track_interval, windows, reuse
    )

    # -- step kind and graphs -------------------------------------------------------------------
    compiled = backend == "compile" or cfg.graphs.compile_in_graph
    native = cpu is not None and cpu.native
    stack = cpu.stack if cpu is not None else None
    eager_path, captured_path = compute_paths(device, native, compiled, stack)
    pools = StepPools(req_to_token.table, kv, recurrent, compute=eager_path)
    kind_cls = step_kind_for(contract)
    kind = kind_cls(model, pools, captured_path, contract.vocab_size, max_context, cpu)
    graphs = build_graphs(cfg, kind, backend, buckets, max_context, loaded.weight_bytes, contract)

    # -- scheduler and loops --------------------------------------------------------------------
    eos = list(loaded.eos_token_ids)
    rows = contract.rows
    if rows is not None and rows.end_id not in eos:
        eos.append(rows.end_id)  # a row model's end row stops it
    tokenizer = load_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else loaded.tokenizer
    if tokenizer is not None:
        tokenizer.eos_ids = tokenizer.eos_ids or list(loaded.eos_token_ids)
        tokenizer.name_or_path = cfg.model.tokenizer or cfg.model.path or loaded.source
    speculator = speculator_for(cfg, contract, kv.swa is not None)
    scheduler = Scheduler(
        cache, cfg.scheduler, max_running, fence, tokenizer, kind.features, speculator
    )
    recorder = StepRecorder(DeviceClock(device), graphs.runner)
    pipeline = StepPipeline(kind, graphs, scheduler, fence, recorder)
    derived = Derived(
        max_context=max_context,
        max_running=max_running,
        vocab_size=contract.vocab_size,
        kv_pages=kv.allocator.num_pages,
        kv_tokens=kv.allocator.capacity,
        kv_bytes=kv.nbytes(),
        swa_window=contract.sliding_window if kv.swa is not None else None,
        swa_pages=kv.swa.allocator.num_pages if kv.swa is not None else 0,
        swa_bytes=kv.swa.nbytes() if kv.swa is not None else 0,
        recurrent_slots=recurrent.num_slots if recurrent is not None else 0,
        recurrent_bytes=recurrent.nbytes() if recurrent is not None else 0,
        track_interval=track_interval,
        cache=type(tree).__name__,
        backend=backend,
        step=kind_cls.__name__,
        row_channels=rows.channels if rows is not None else 0,
        end_id=rows.end_id if rows is not None else -1,
        channel_vocab_sizes=rows.channel_vocab_sizes if rows is not None else (),
        eos_token_ids=tuple(eos),
        sampling_defaults={
            **generation_defaults(cfg.model.generation_config, loaded.source),
            **cfg.sampling_defaults.model_dump(exclude_none=True),
        },
        weight_bytes=loaded.weight_bytes,
        packed_linears=len(cpu.layers) if cpu is not None else 0,
        quantized_linears=dict(loaded.quantized),
        cpu_kernels=cpu.summary() if cpu is not None else None,
        numerics=cpu.numerics() if cpu is not None else f"{cfg.dtype} torch ops on {device}",
    )
    log.info("hyloop assembly: %s", asdict(derived))
    engine = engine_type(cfg, derived, model, tokenizer, kind, graphs, pipeline, recorder)
    trim_heap()  # the load's temporaries, freed, leave the process (``host_memory``)
    return engine


def step_kind_for(contract: ModelContract) -> type[StepKind]:
    """Row models decode a frame a step (``hyloop.tts.frame_step``); the rest a token."""
    from hyloop.tts.frame_step import FrameStep

    return TokenStep if contract.rows is None else FrameStep


def build_graphs(
    cfg: EngineConfig,
    kind: StepKind,
    backend: str,
    buckets: list[int],
    max_context: int,
    weight_bytes: int,
    contract: ModelContract,
) -> Graphs:
    """The bucket runner over the kind's capture buffer, and its capture policy."""
    g = cfg.graphs
    device = kind.device
    kv_buckets = kv_len_buckets(
        max_context, multiple=g.kv_len_bucket or None, pow2=g.kv_len_bucket == 0
    )
    channels = contract.rows.channels if contract.rows is not None else None
    buffer = CaptureBuffer.init(buckets[-1], kind.captured_pools, kv_buckets[-1], channels)
    spec = cfg.speculative
    verify = None  # verify steps' buffer: a row and its drafts (``hyloop.speculative``)
    if spec.method is not None and channels is None:
        k1 = spec.num_speculative_tokens + 1
        verify = CaptureBuffer.init(buckets[-1], kind.captured_pools, kv_buckets[-1], None, k1)
    cpu_options = {**cpu_ops.compile_options(), **kind.cpu_compile_options}
    options = {**(cpu_options if device.type == "cpu" else {}), **g.compile_options}
    runner = BucketRunner(
        kind,
        buffer,
        backend=backend,  # type: ignore[arg-type]
        buckets=buckets,
        kv_len_buckets=kv_buckets,
        oversize=g.oversize,
        compile_in_graph=g.compile_in_graph,
        compile_options=options,
        name=f"decode-{type(kind.model).__name__}-{id(kind):x}",
        lazy=g.backend != "auto",
        verify_buffer=verify,
    )
    defaults = Estimates.defaults(
        device=device.type,
        weight_bytes=weight_bytes,
        num_layers=max(1, len(kind.pools.kv.k)),
        compile_in_graph=g.compile_in_graph,
    )
    history = step_history(cfg, type(kind).__name__)
    max_running = cfg.scheduler.max_running_requests
    return Graphs(
        runner,
        auto=g.backend == "auto",
        max_running=max_running,
        history=history,
        defaults=defaults,
    )


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
        cfg.model.weights,
    )
    return StepHistory(cache_dir() / "steps" / f"{key}.json")
