"""The engine config: YAML (omegaconf) -> frozen pydantic models.

``load_config(files, overrides)`` merges YAML files left to right (a file may list parent files
under ``defaults:``, merged before it), applies dotlist overrides (``kv_pool.page_size=16``),
resolves ``${}`` interpolation (``config_files``) and validates. A bad key or value raises
``ConfigError`` naming the dotted key, the bad value and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hyloop.framework.config_files import ConfigError, merge_config
from hyloop.speculative.section import SpeculativeSection

__all__ = ["CONFIG_DIR", "ConfigError", "EngineConfig", "load_config", "merge_config"]

if TYPE_CHECKING:
    import torch


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The presets shipped inside the package: ``engine.yaml`` (every key with its default),
``models/`` and ``recipes/``. Package data, so an installed hyloop finds them too."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSection(_Section):
    path: str | None = Field(None, description="HF checkpoint directory or .gguf file")
    max_context: int | None = Field(
        None, ge=2, description="longest prompt + output served; default min(model limit, 8192)"
    )
    tokenizer: str | None = Field(
        None, description="HF directory or .gguf whose tokenizer to use; default the model's"
    )
    max_logprobs: int = Field(
        20, ge=0, description="most logprobs / prompt_logprobs a request may ask for (vLLM's)"
    )
    generation_config: str = Field(
        "auto",
        description="request defaults: auto (the checkpoint's generation_config.json), vllm "
        "(vLLM's SamplingParams defaults only) or a directory holding a generation_config.json",
    )
    cpu_packed_linear: bool = Field(
        True, description="CPU: pre-pack Linear weights for oneDNN once (no re-pack per call)"
    )
    cpu_kernels: Literal["auto", "packed"] = Field(
        "auto",
        description="CPU GEMM of dense Linears, the same at every row count: auto (hyloop's "
        "panel GEMMs where its CPU kernels are loaded on an AVX-512 CPU, else oneDNN's packed "
        "GEMM) or packed (oneDNN's everywhere); never chosen by a timing",
    )
    cpu_ops: Literal["auto"] | bool = Field(
        "auto",
        description="CPU: hyloop's C++ kernels (panel GEMMs, the decoder stack, decode "
        "attention over the paged pool, a sampler's top-k, the packed GEMM called from compiled "
        "steps), kept under $HYLOOP_CACHE_DIR/cpu_ops: auto or true build them when a model "
        "loads if they are missing (once per machine; without a compiler auto runs torch ops, "
        "which compute the quantized modes' same bits); false: plain torch ops",
    )
    cpu_stack: Literal["auto"] | bool = Field(
        "auto",
        description="CPU decode steps of a dense Llama / Qwen2 / Qwen3 model run every layer "
        "in one C++ call (the layers' own panels on one team of threads; needs cpu_ops and "
        "cpu_kernels=auto): auto where the CPU has AVX-512 (its kernels are vectorised for "
        "it), true wherever the model allows, false layer by layer",
    )
    weights: Literal["auto", "dequantize", "int8", "int4"] = Field(
        "auto",
        description="Linear weights: auto (a GGUF's quantized tensors stay quantized where CPU "
        "kernels run them: 4-bit blocks as int4 with the file's codes, other types as int8; "
        "dense checkpoints stay dense), dequantize (every weight dense in dtype), int8 / int4 "
        "(every large Linear so, requantized where the file held another format)",
    )


class KVPoolSection(_Section):
    page_size: int = Field(1, ge=1, description="KV slots per page (tree keys split at pages)")
    num_pages: int | None = Field(
        None, ge=2, description="pages in the pool (page 0 is the padding sink); else from budget"
    )
    memory_budget_mb: float = Field(
        512.0, gt=0, description="KV memory budget when num_pages is not given"
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="CUDA: size the budget as this share of the device's memory, less what is "
        "in use once the weights are loaded (vLLM's gpu_memory_utilization)",
    )
    swa_pool: bool = Field(
        True,
        description="sliding-window layers keep KV for their window only, in a pool of their own",
    )
    swa_num_pages: int | None = Field(
        None,
        ge=2,
        description="pages of the sliding-window pool; default: two windows per running request, "
        "within half of memory_budget_mb",
    )


class RecurrentPoolSection(_Section):
    num_slots: int | None = Field(None, ge=1, description="state slots; default from max_running")
    track_interval: int | None = Field(
        None, ge=1, description="track boundary spacing; default the prefill chunk size"
    )


class PositionIndependentSection(_Section):
    enable: bool = Field(
        False, description="reuse KV of prompt text found anywhere in the cache, at a new offset"
    )
    window: int = Field(64, ge=1, le=64, description="tokens the chunk-boundary hash depends on")
    boundary_bits: int = Field(
        6, ge=1, le=32, description="a chunk ends where this many top hash bits are 0"
    )
    min_chunk: int = Field(32, ge=1, description="shortest chunk (tokens)")
    max_chunk: int = Field(512, ge=1, description="longest chunk (tokens)")
    sink_tokens: int = Field(32, ge=0, description="leading positions never reused (sinks)")
    recompute_tokens: int = Field(
        16, ge=0, description="leading tokens of each reused run computed anyway"
    )
    recompute_ratio: float = Field(
        0.15,
        ge=0.0,
        le=1.0,
        description="share of each prefill chunk's reused tokens computed again, those whose "
        "K at check_layer deviates most, weighted by the attention the chunk's last tokens pay "
        "them (CacheBlend); 0: reused spans skip prefill",
    )
    check_layer: int = Field(
        3,
        ge=1,
        description="layer whose fresh K/V picks the tokens recompute_ratio recomputes (at most "
        "the model's last layer but one)",
    )

    @model_validator(mode="after")
    def _check_clamps(self) -> PositionIndependentSection:
        if self.min_chunk > self.max_chunk:
            raise ValueError(
                f"min_chunk={self.min_chunk} must not exceed max_chunk={self.max_chunk}"
            )
        return self


class CacheSection(_Section):
    enable: bool = Field(True, description="prefix reuse through the UHRC")
    position_independent: PositionIndependentSection = PositionIndependentSection()

    @model_validator(mode="after")
    def _check_reuse(self) -> CacheSection:
        if self.position_independent.enable and not self.enable:
            raise ValueError("position_independent.enable needs the prefix cache (cache.enable)")
        return self


class GraphsSection(_Section):
    backend: Literal["auto", "eager", "compile", "cuda_graph"] = Field(
        "auto",
        description=(
            "how the decode step runs; auto: cuda_graph on CUDA, compile on CPU, for the "
            "buckets a job pays for (planned when the engine goes busy), eager for the rest"
        ),
    )
    buckets: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32], description="decode batch buckets"
    )
    kv_len_bucket: int = Field(
        256, ge=0, description="decode context rounded up to multiples of this; 0: powers of two"
    )
    oversize: Literal["split", "eager"] = Field(
        "split", description="a decode batch above the largest bucket: split it, or run eager"
    )
    compile_in_graph: bool = Field(
        False, description="cuda_graph: capture around the torch.compile'd step"
    )
    compile_options: dict[str, Any] = Field(
        default_factory=dict, description="inductor options for compiled steps, e.g. freezing"
    )

    @model_validator(mode="after")
    def _check_buckets(self) -> GraphsSection:
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be a non-empty list of ints >= 1, got {self.buckets}")
        return self


class SchedulerSection(_Section):
    max_running_requests: int = Field(64, ge=1, description="requests decoding at once")
    prefill_chunk: int = Field(512, ge=1, description="largest prefill chunk of one request")
    prefill_token_budget: int = Field(2048, ge=1, description="prefill tokens in one step")


class SamplingDefaultsSection(_Section):
    """Defaults of requests that give no SamplingParams; unset (null): the model's
    generation_config.json (``model.generation_config``), else vLLM's SamplingParams()."""

    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)


class LookaheadSection(_Section):
    enable: bool | Literal["auto"] = Field(
        "auto",
        description="launch step N+1 before resolving step N; auto: on with CUDA, where the "
        "step runs asynchronously, off on CPU, where the step and the host share the cores "
        "and the GIL (see bench/lookahead.py)",
    )

    def enabled_on(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.enable == "auto" else bool(self.enable)

    min_batch: int = Field(8, ge=1, description="smallest decode batch that uses lookahead")


class EngineConfig(_Section):
    model: ModelSection = ModelSection()
    kv_pool: KVPoolSection = KVPoolSection()
    recurrent_pool: RecurrentPoolSection = RecurrentPoolSection()
    cache: CacheSection = CacheSection()
    graphs: GraphsSection = GraphsSection()
    scheduler: SchedulerSection = SchedulerSection()
    sampling_defaults: SamplingDefaultsSection = SamplingDefaultsSection()
    lookahead: LookaheadSection = LookaheadSection()
    speculative: SpeculativeSection = SpeculativeSection()
    device: str = Field("cpu", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype weights are stored and computed in"
    )
    seed: int = Field(0, description="seed for requests that give none")

    @model_validator(mode="after")
    def _check_track(self) -> EngineConfig:
        ti = self.recurrent_pool.track_interval
        if ti is not None and ti % self.kv_pool.page_size:
            raise ValueError(
                f"recurrent_pool.track_interval={ti} must be a positive multiple of "
                f"kv_pool.page_size={self.kv_pool.page_size}"
            )
        return self


def load_config(
    files: list[str | Path] | str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> EngineConfig:
    """Merge ``base`` < files < dotlist ``overrides`` and validate."""
    return validate_config(merge_config(files, overrides, base))


def validate_config(data: dict[str, Any]) -> EngineConfig:
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None


def _format(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown config key (value {value!r})")
        else:
            lines.append(f"{key}: got {value!r}; {err['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)
