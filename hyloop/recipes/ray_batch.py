"""Offline generation over Ray Data: one engine per actor, rows sharded by prompt prefix.

``EngineReplica`` is a callable class for ``Dataset.map_batches``: each actor builds one engine
and adds ``OUTPUT_TYPES`` columns to a batch of prompt and sampling fields. With
``ray.prefix_affinity`` (the default) rows sharing their first page-aligned block of tokens go to
one replica (see ``prefix_shards``), so a shared prefix is computed once, not once per replica.

The recipe's keys live under ``ray.`` and are taken off before the engine config is validated:
the engine knows nothing of Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import ray.data
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hyloop.api.llm import LLM
from hyloop.framework.config import ConfigError, EngineConfig, merge_config, validate_config
from hyloop.framework.sampling_params import SamplingParams
from hyloop.models.loader import load_tokenizer
from hyloop.recipes.offline import (
    Prompt,
    error_text,
    generate_isolated,
    prepare,
)
from hyloop.recipes.prefix_shards import ShardPlan, key_block, plan_shards
from hyloop.recipes.ray_blocks import (
    REQUEST,
    REQUEST_FIELDS,
    ROW,
    WHERE,
    batch_rows,
    indexed_blocks,
    prefix_keys,
    regroup,
)
from hyloop.recipes.records import failed_fields, result_fields

ConfigSource = str | Path | list[str | Path] | dict[str, Any] | None  # YAML path(s) or a dict
LOGPROB = pa.struct(  # one entry of a position's logprobs (see hyloop.recipes.records)
    [
        ("token_id", pa.int64()),
        ("logprob", pa.float64()),
        ("rank", pa.int64()),
        ("decoded_token", pa.string()),
    ]
)
OUTPUT_TYPES = {  # the columns a replica adds (``result_fields``), with their Arrow types
    "text": pa.string(),
    "token_ids": pa.list_(pa.int64()),
    "finish_reason": pa.string(),
    "stop_reason": pa.int64(),
    "num_prompt_tokens": pa.int64(),
    "num_cached_tokens": pa.int64(),
    "cumulative_logprob": pa.float64(),
    "logprobs": pa.list_(pa.list_(LOGPROB)),
    "error": pa.string(),
}
COUNTS = ("num_prompt_tokens", "num_cached_tokens")  # never null: plain int64 numpy columns


class RaySection(BaseModel):
    """The ``ray.`` keys: how rows reach the replicas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str | None = Field(None, description="Ray cluster to join; None: a local Ray")
    prefix_affinity: bool = Field(True, description="shard by prompt prefix; false: Ray's split")
    prefix_tokens: int = Field(128, ge=1, description="tokens the prefix key covers (paged)")
    max_imbalance: float = Field(1.25, ge=1.0, description="most rows a replica takes / mean")
    batch_size: int = Field(64, ge=1, description="rows per map_batches call of a replica")
    num_cpus: float = Field(1.0, gt=0, description="CPUs each replica actor reserves")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica actor reserves")


def split_config(
    config: ConfigSource, overrides: list[str] | None = None
) -> tuple[EngineConfig, RaySection]:
    """``config`` (YAML path(s) or a partial dict, over the defaults) and dotlist ``overrides``,
    split into the engine config and the recipe's ``ray.`` keys."""
    if isinstance(config, dict):
        data = merge_config(None, overrides, base=config)
    else:
        data = merge_config(config, overrides)
    ray_keys = data.pop("ray", None) or {}
    try:
        section = RaySection.model_validate(ray_keys)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in ("ray", *err["loc"]))
        raise ConfigError(f"{key}: got {err.get('input')!r}; {err['msg']}") from e
    return validate_config(data), section


class EngineReplica:
    """One engine per actor, for ``ds.map_batches(EngineReplica, fn_constructor_kwargs=...)``.

    ``config``: an ``EngineConfig``, YAML path(s) or a dict (``ray.`` keys are ignored here). A
    row that cannot run fails alone, with ``finish_reason`` ``"error"`` and an ``error`` naming
    it: its ``WHERE`` label when the batch has one, else ``row N`` (N: its ``ROW`` when the batch
    carries it, else its place in the batch).
    """

    def __init__(
        self,
        config: EngineConfig | ConfigSource = None,
        overrides: list[str] | None = None,
    ) -> None:
        if isinstance(config, EngineConfig):
            engine_cfg = config
            if overrides:
                engine_cfg = split_config(config.model_dump(), overrides)[0]
        else:
            engine_cfg = split_config(config, overrides)[0]
        self.llm = LLM(config=engine_cfg)
        self.defaults = self.llm.engine.default_params()

    def __call__(self, batch: dict[str, np.ndarray] | pa.Table) -> dict[str, np.ndarray] | pa.Table:
        """A numpy batch or an Arrow table in, the same kind out. ``generate_dataset`` passes
        tables: other columns pass through untouched, and the added ones get one Arrow type
        whatever the batch holds."""
        if isinstance(batch, pa.Table):
            wanted = (REQUEST, ROW, WHERE, *REQUEST_FIELDS)
            names = [f for f in wanted if f in batch.column_names]
            results = self.run({f: batch.column(f).to_pylist() for f in names}, batch.num_rows)
            table = batch.drop_columns([f for f in OUTPUT_TYPES if f in batch.column_names])
            for name, kind in OUTPUT_TYPES.items():
                table = table.append_column(name, pa.array([r[name] for r in results], kind))
            return table
        results = self.run(batch, len(next(iter(batch.values()), [])))
        out = dict(batch)
        for name in OUTPUT_TYPES:
            if name in COUNTS:
                out[name] = np.array([r[name] for r in results], dtype=np.int64)
                continue
            column = np.empty(len(results), dtype=object)
            for i, result in enumerate(results):
                value = result[name]
                column[i] = np.asarray(value, dtype=np.int64) if name == "token_ids" else value
            out[name] = column
        return out

    def run(self, columns: Mapping[str, Any], num_rows: int) -> list[dict[str, Any]]:
        """The ``OUTPUT_TYPES`` fields of each row given by ``columns`` (see ``batch_rows``)."""
        rows = batch_rows(columns, num_rows)
        if WHERE in columns:
            labels = [str(w) for w in columns[WHERE]]
        else:
            labels = [f"row {int(i)}" for i in columns.get(ROW, range(num_rows))]
        results: list[dict[str, Any]] = [{} for _ in rows]
        ready: list[tuple[int, Prompt, SamplingParams]] = []
        for i, (where, row) in enumerate(zip(labels, rows, strict=True)):
            try:
                ready.append((i, *prepare(self.llm, where, row, self.defaults)))
            except (ValueError, TypeError) as e:
                results[i] = failed_fields(error_text(where, e))
        has_text = self.llm.tokenizer is not None
        items = [(p, s) for _, p, s in ready]
        for j, out in generate_isolated(self.llm, items):
            i, _, params = ready[j]
            if isinstance(out, ValueError):
                results[i] = failed_fields(error_text(labels[i], out))
            else:
                results[i] = result_fields(out, params, has_text)
        return results


def shard_by_prefix(
    blocks: list[ray.ObjectRef], engine_cfg: EngineConfig, opts: RaySection, replicas: int
) -> tuple[list[ray.data.Dataset], ShardPlan]:
    """Key every row of ``blocks`` (from ``indexed_blocks``) by its prompt prefix, plan the
    shards, and return one dataset per replica, in its run order."""
    page_size = engine_cfg.kv_pool.page_size
    tokenizer = load_tokenizer(engine_cfg.model.path) if engine_cfg.model.path else None
    block = key_block(opts.prefix_tokens, page_size)
    tok_ref = ray.put(tokenizer)
    keys = ray.get([prefix_keys.remote(b, tok_ref, block, page_size) for b in blocks])
    plan = plan_shards(np.concatenate([np.empty(0, np.int64), *keys]), replicas, opts.max_imbalance)
    # A shard comes as blocks of about batch_size rows: one replica call each, so progress and
    # a retry after a replica dies are one batch.
    chunks = [max(1, math.ceil(n / opts.batch_size)) for n in plan.sizes]
    shards = regroup(blocks, plan.replica_of(), plan.position(), chunks)
    return [ray.data.from_arrow_refs(shard) for shard in shards], plan


# -- the job ------------------------------------------------------------------------------------
def _replica_map(
    ds: ray.data.Dataset, engine_cfg: EngineConfig, opts: RaySection, size: int
) -> ray.data.Dataset:
    return ds.map_batches(
        EngineReplica,
        fn_constructor_kwargs={"config": engine_cfg},
        batch_size=opts.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=opts.num_cpus,
        num_gpus=opts.num_gpus,
        # NOTE: Ray Data creates pool actors with max_restarts=-1 and max_task_retries=-1: a
        # replica that dies is restarted (its engine rebuilt) and its batch runs again, and
        # Ray keeps one result per batch, so every row comes out exactly once.
    )


def generate_rows(
    ds: ray.data.Dataset, config: ConfigSource, overrides: list[str] | None, replicas: int
) -> ray.data.Dataset:
    """The generated rows, each with ``ROW`` (its index in ``ds``), in the order they finish:
    a lazy dataset whose blocks stream out as replicas complete their batches."""
    if replicas < 1:
        raise ValueError(f"replicas: got {replicas}; expected an int >= 1")
    engine_cfg, opts = split_config(config, overrides)
    blocks = indexed_blocks(ds)
    if not opts.prefix_affinity:
        return _replica_map(ray.data.from_arrow_refs(blocks), engine_cfg, opts, replicas)
    shards, plan = shard_by_prefix(blocks, engine_cfg, opts, replicas)
    # One single-actor pool per shard pins each shard to its own replica.
    outs = [
        _replica_map(shard, engine_cfg, opts, 1)
        for shard, size in zip(shards, plan.sizes, strict=True)
        if size
    ]
    return outs[0].union(*outs[1:]) if len(outs) > 1 else outs[0]


def generate_dataset(
    ds: ray.data.Dataset,
    config: ConfigSource = None,
    overrides: list[str] | None = None,
    replicas: int = 1,
) -> ray.data.Dataset:
    """``ds`` with the generation columns added, in input order, through ``replicas`` engines.

    ``config`` is YAML path(s) or a dict, possibly partial, merged over the defaults;
    ``overrides`` may mix engine keys (``kv_pool.page_size=16``) with ``ray.`` keys.
    """
    out = generate_rows(ds, config, overrides, replicas).materialize()
    blocks = out.to_arrow_refs()
    rows = int(out.count())
    parts = max(1, len(blocks))
    # Blocks of consecutive rows, in input order. The row column goes in a task per block, not
    # a Dataset op: Ray Data's map ops may hand blocks on in the order they finish.
    ordered = regroup(blocks, np.arange(rows) * parts // max(rows, 1), None, [1] * parts)
    return ray.data.from_arrow_refs([_drop_row.remote(part[0]) for part in ordered])


@ray.remote
def _drop_row(table: pa.Table) -> pa.Table:
    return table.drop_columns([ROW])


def init_ray(address: str | None) -> None:
    """Join ``address``, or start a local Ray; a running one is kept."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False if address is None else None)
