"""vLLM's engine arguments as a front door onto hyloop's config.

``EngineArgs`` takes vLLM's keyword names (``LLM(model, max_model_len=..., enforce_eager=...)``)
and turns the ones given into dotlist overrides of ``EngineConfig``: a config file and
``overrides`` still configure everything, and an argument given here wins over both. An argument
hyloop has no use for is accepted and logged (tensor parallelism: hyloop runs one device, with
the same outputs); one it cannot honour (LoRA, float16, CPU offload, ...) is a
``NotSupportedError`` naming it; an unknown name is an error
listing the near ones. The README's table lists every mapping.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyloop.framework.config import EngineConfig, SamplingDefaultsSection, load_config
from hyloop.framework.sampling_params import NotSupportedError
from hyloop.models.loader import GENERATION_CONFIG_FIELDS

log = logging.getLogger(__name__)

_MB = 2**20


def _key(key: str) -> Callable[[Any], list[str]]:
    return lambda v: [f"{key}={v}"]


def _dtype(value: str) -> list[str]:
    names = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16"}
    if value == "auto":
        return []
    if value not in names:
        raise NotSupportedError(f"dtype={value!r}: hyloop computes in float32 or bfloat16")
    return [f"dtype={names[value]}"]


def _generation_overrides(value: dict[str, Any]) -> list[str]:
    out = []
    for k, v in value.items():
        name = GENERATION_CONFIG_FIELDS.get(k, k)
        if name not in SamplingDefaultsSection.model_fields:
            raise NotSupportedError(f"override_generation_config: {k!r} is not applied by hyloop")
        out.append(f"sampling_defaults.{name}={v}")
    return out


def speculative_overrides(value: dict[str, Any] | str) -> list[str]:
    """vLLM's ``speculative_config`` (a dict, or its JSON on the command line): n-gram
    prompt lookup maps to the ``speculative`` section; another method is refused."""
    spec = json.loads(value) if isinstance(value, str) else dict(value)
    method = spec.pop("method", None) or ("ngram" if spec.pop("model", None) == "[ngram]" else None)
    if method != "ngram":
        raise NotSupportedError(
            f"speculative_config method={method!r}: hyloop speculates with ngram (prompt lookup)"
        )
    out = ["speculative.method=ngram"]
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"):
        if spec.get(name) is not None:
            out.append(f"speculative.{name}={spec.pop(name)}")
        spec.pop(name, None)
    if spec:
        raise NotSupportedError(f"speculative_config: {sorted(spec)} not applied by hyloop")
    return out


# name -> (CLI type, how a given value maps onto the config)
_MAPPED: dict[str, tuple[Any, Callable[[Any], list[str]]]] = {
    "model": (str, _key("model.path")),
    "tokenizer": (str, _key("model.tokenizer")),
    "dtype": (str, _dtype),
    "seed": (int, _key("seed")),
    "max_model_len": (int, _key("model.max_context")),
    "max_num_seqs": (int, _key("scheduler.max_running_requests")),
    "max_num_batched_tokens": (int, _key("scheduler.prefill_token_budget")),
    "enforce_eager": (bool, lambda v: ["graphs.backend=eager"] if v else []),
    "enable_prefix_caching": (bool, _key("cache.enable")),
    "block_size": (int, _key("kv_pool.page_size")),
    "kv_cache_memory_bytes": (int, lambda v: [f"kv_pool.memory_budget_mb={v / _MB}"]),
    "gpu_memory_utilization": (float, _key("kv_pool.gpu_memory_utilization")),
    "device": (str, lambda v: [] if v == "auto" else [f"device={v}"]),
    "generation_config": (str, _key("model.generation_config")),
    "override_generation_config": (json.loads, _generation_overrides),
    "max_logprobs": (int, _key("model.max_logprobs")),
    "speculative_config": (json.loads, speculative_overrides),
}
# vLLM arguments with no effect in hyloop, at their neutral value: another value is logged
# (``None`` in the set: any value is fine) or, for those in _REFUSED, an error.
_INERT: dict[str, Any] = {
    "trust_remote_code": False,
    "tokenizer_mode": "auto",
    "revision": None,
    "tokenizer_revision": None,
    "code_revision": None,
    "download_dir": None,
    "hf_token": None,
    "load_format": "auto",
    "swap_space": 4,
    "disable_log_stats": False,
    "enable_chunked_prefill": None,
    "disable_custom_all_reduce": False,
    "max_seq_len_to_capture": None,
    "served_model_name": None,
    "skip_tokenizer_init": False,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "cpu_offload_gb": 0,
    "quantization": None,
    "kv_cache_dtype": "auto",
    "enable_lora": False,
    "hf_overrides": None,
    "compilation_config": None,
    "distributed_executor_backend": None,
    "limit_mm_per_prompt": None,
    "mm_processor_kwargs": None,
    "logits_processors": None,
    "structured_outputs_config": None,
    "enable_log_requests": False,
    "disable_log_requests": None,
    "runner": "auto",
    "task": "auto",
    # LoRA sizing: read only with enable_lora, which hyloop refuses; any value is inert.
    "max_lora_rank": None,
    "max_loras": None,
    "max_cpu_loras": None,
    "lora_extra_vocab_size": None,
    "lora_dtype": None,
    "fully_sharded_loras": None,
}
_ONE_DEVICE = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}
_REFUSED = {
    "cpu_offload_gb",
    "kv_cache_dtype",
    "enable_lora",
    "hf_overrides",
    "skip_tokenizer_init",
    "distributed_executor_backend",
    "logits_processors",
    "structured_outputs_config",
    "mm_processor_kwargs",
    "limit_mm_per_prompt",
}
_QUANTIZATION_OK = (None, "gguf")
# vLLM booleans unset by default
_FLAGS = {"enable_chunked_prefill", "disable_log_requests", "fully_sharded_loras"}
_HYLOOP = {"config": None, "overrides": None}
FIELDS = (*_MAPPED, *_INERT, *_HYLOOP)


class EngineArgs:
    """vLLM's ``EngineArgs`` over hyloop's config; ``config`` (YAML file(s) or an
    ``EngineConfig``) and ``overrides`` (``["kv_pool.page_size=16"]``) are hyloop's own."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        kwargs["model"] = str(model) if model is not None else None
        for name in kwargs:
            if name not in FIELDS:
                near = difflib.get_close_matches(name, FIELDS, n=3)
                hint = f"; did you mean {', '.join(near)}?" if near else ""
                raise ValueError(f"unknown engine argument {name!r}{hint}")
        for name in FIELDS:
            setattr(self, name, kwargs.get(name, _INERT.get(name)))

    def __repr__(self) -> str:
        given = {n: v for n in FIELDS if (v := getattr(self, n)) is not None and v != _INERT.get(n)}
        return f"EngineArgs({', '.join(f'{k}={v!r}' for k, v in given.items())})"

    def to_overrides(self) -> list[str]:
        """The dotlist overrides the given vLLM arguments stand for."""
        out: list[str] = []
        for name, (_, mapping) in _MAPPED.items():
            value = getattr(self, name)
            if name == "gpu_memory_utilization" and self.kv_cache_memory_bytes is not None:
                continue  # vLLM: an explicit KV size wins over the utilization
            if value is not None:
                out += mapping(value)
        for name, neutral in _INERT.items():
            value = getattr(self, name)
            if value is None or value == neutral:
                continue
            ok = value in _QUANTIZATION_OK if name == "quantization" else name not in _REFUSED
            if not ok:
                raise NotSupportedError(f"engine argument {name}={value!r} is not supported")
            if name in _ONE_DEVICE:
                log.warning("%s=%r: hyloop runs the model on one device", name, value)
            elif name != "quantization":
                log.info("engine argument %s=%r has no effect in hyloop", name, value)
        return out

    def create_engine_config(self) -> EngineConfig:
        mapped = self.to_overrides()
        config = self.config
        if isinstance(config, EngineConfig):
            return load_config(None, [*(self.overrides or []), *mapped], base=config.model_dump())
        return load_config(config, [*(self.overrides or []), *mapped])

    # -- the command line ------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """vLLM's engine flags (``--max-model-len``...) plus ``--config`` and ``--override``;
        every default is None: hyloop's config decides what is not given."""
        for name, (kind, _) in _MAPPED.items():
            flag = "--" + name.replace("_", "-")
            if kind is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
            else:
                parser.add_argument(flag, type=kind, default=None)
        for name, neutral in _INERT.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(neutral, bool) or name in _FLAGS:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
            else:
                kind = type(neutral) if neutral is not None else str
                parser.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
        parser.add_argument("--config", action="append", default=None, help="hyloop YAML config")
        parser.add_argument(
            "--override", dest="overrides", action="append", default=None, metavar="KEY=VALUE"
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        given = {n: getattr(args, n) for n in FIELDS if getattr(args, n, None) is not None}
        return cls(**given)


@dataclass(frozen=True)
class ModelConfig:
    """vLLM's ``LLMEngine.model_config``: what clients read of the model an engine serves."""

    model: str
    tokenizer: str
    max_model_len: int
    dtype: torch.dtype
    seed: int
    max_logprobs: int
    vocab_size: int
    generation_config: str = "auto"
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    skip_tokenizer_init: bool = False
    runner_type: str = "generate"

    @classmethod
    def of(cls, cfg: EngineConfig, max_context: int, vocab_size: int) -> ModelConfig:
        path = cfg.model.path or ""
        return cls(
            model=path,
            tokenizer=cfg.model.tokenizer or path,
            max_model_len=max_context,
            dtype=getattr(torch, cfg.dtype),
            seed=cfg.seed,
            max_logprobs=cfg.model.max_logprobs,
            vocab_size=vocab_size,
            generation_config=cfg.model.generation_config,
        )

    @property
    def served_model_name(self) -> str:
        return self.model

    @property
    def quantization(self) -> str | None:
        return "gguf" if self.model.endswith(".gguf") else None

    def get_vocab_size(self) -> int:
        return self.vocab_size


class EngineConfigs:
    """What vLLM's ``LLMEngine`` exposes of its configuration, over the ``cfg``,
    ``max_context`` and ``vocab_size`` an engine holds."""

    cfg: EngineConfig
    max_context: int
    vocab_size: int

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's ``LLMEngine.model_config``: ``max_model_len``, ``model``, ``dtype``..."""
        return ModelConfig.of(self.cfg, self.max_context, self.vocab_size)
