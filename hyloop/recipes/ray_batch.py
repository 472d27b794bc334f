"""Offline generation over Ray Data: one engine per actor, rows sharded by prompt prefix.

``EngineReplica`` is a callable class for ``Dataset.map_batches``: each actor builds one engine
and turns a numpy batch with ``prompt`` / ``prompt_token_ids`` / ``messages`` and the JSONL
sampling fields into the same batch plus ``text``, ``token_ids``, ``finish_reason``,
``num_cached_tokens``, ``num_prompt_tokens`` and ``error``. ``generate_dataset`` runs a dataset
through ``replicas`` of them. With ``ray.prefix_affinity`` (the default) rows sharing their first
page-aligned block of tokens go to one replica (see ``prefix_shards``), so each shared prefix is
computed once and not once per replica; without it Ray splits the rows as it always does.

The recipe's own keys live under ``ray.`` in the config or the overrides and are taken off
before the engine config is validated; the engine knows nothing of Ray.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import ray.data
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hyloop.framework.config import ConfigError, EngineConfig, merge_config, validate_config
from hyloop.framework.llm import LLM
from hyloop.framework.sampling_params import SamplingParams
from hyloop.models.loader import load_tokenizer
from hyloop.models.tokenizer import TextTokenizer
from hyloop.recipes.offline import (
    PROMPT_FIELDS,
    SAMPLING_FIELDS,
    default_checkpoint,
    read_jsonl,
    row_params,
    row_prompt,
)
from hyloop.recipes.prefix_shards import ShardPlan, key_block, plan_shards, prefix_key

ROW = "_hyloop_row"  # the row's index in the input dataset
KEY = "_hyloop_prefix_key"
POSITION = "_hyloop_position"  # the row's place in the sharded order
OUTPUT_FIELDS = (
    "text",
    "token_ids",
    "finish_reason",
    "num_cached_tokens",
    "num_prompt_tokens",
    "error",
)
INT_FIELDS = {"max_tokens", "top_k", "seed", "logprobs"}


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
    config: str | Path | list[str | Path] | dict[str, Any] | None,
    overrides: list[str] | None = None,
) -> tuple[EngineConfig, RaySection]:
    """``config`` (YAML path(s) or a possibly partial dict, over the defaults) and dotlist
    ``overrides``, split into the engine config and the recipe's ``ray.`` keys."""
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


def _cell(value: Any) -> Any:
    """A batch cell as plain Python (numpy scalars and arrays unwrapped, NaN as missing)."""
    if isinstance(value, np.ndarray):
        return [_cell(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _cell(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_cell(v) for v in value]
    return value


def batch_rows(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The prompt and sampling fields each row of a numpy batch gives (missing ones left out)."""
    fields = [f for f in (*PROMPT_FIELDS, *SAMPLING_FIELDS) if f in batch]
    rows: list[dict[str, Any]] = [{} for _ in range(_num_rows(batch))]
    for f in fields:
        column = batch[f]
        # A nullable int column comes back as floats (NaN for missing): undo that, and only that.
        coerced = f in INT_FIELDS and column.dtype.kind == "f"
        for row, value in zip(rows, column, strict=True):
            value = _cell(value)
            if value is None:
                continue
            if coerced and float(value).is_integer():
                value = int(value)
            row[f] = value
    return rows


def _num_rows(batch: dict[str, np.ndarray]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


class EngineReplica:
    """One engine per actor, for ``ds.map_batches(EngineReplica, fn_constructor_kwargs=...)``.

    ``config``: an ``EngineConfig``, YAML path(s) or a dict (``ray.`` keys are ignored here).
    A row that cannot run (bad prompt, bad sampling field) fails alone: its ``error`` names its
    index (``ROW`` when the batch carries it, else its place in the batch) and
    ``finish_reason`` is ``"error"``; the other rows of the batch still run.
    """

    def __init__(
        self,
        config: EngineConfig | str | Path | list[str | Path] | dict[str, Any] | None = None,
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

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = batch_rows(batch)
        labels = batch[ROW].tolist() if ROW in batch else list(range(len(rows)))
        results: list[dict[str, Any]] = [{} for _ in rows]
        ready: list[tuple[int, str | list[int], SamplingParams]] = []
        for i, (label, row) in enumerate(zip(labels, rows, strict=True)):
            where = f"row {label}"
            try:
                prompt = row_prompt(where, row, self.llm.tokenizer)
                self.llm.engine.validate_prompt(where, prompt)
                ready.append((i, prompt, row_params(where, row, self.defaults)))
            except (ValueError, TypeError) as e:
                results[i] = _failed(str(e))
        for i, result in self._generate(ready, labels):
            results[i] = result
        out = dict(batch)
        for name in OUTPUT_FIELDS:
            column = np.empty(len(rows), dtype=object)
            for i, result in enumerate(results):
                column[i] = result[name]
            out[name] = column
        out["num_cached_tokens"] = out["num_cached_tokens"].astype(np.int64)
        out["num_prompt_tokens"] = out["num_prompt_tokens"].astype(np.int64)
        return out

    def _generate(
        self, ready: list[tuple[int, str | list[int], SamplingParams]], labels: list[Any]
    ) -> list[tuple[int, dict[str, Any]]]:
        if not ready:
            return []
        try:
            outs = self.llm.generate(
                [p for _, p, _ in ready], [s for *_, s in ready], use_tqdm=False
            )
        except ValueError as e:
            # A request the engine refuses on admission (it would not fit the pool) aborts the
            # whole call: run the rows one by one so only that one fails.
            if len(ready) == 1:
                return [(ready[0][0], _failed(f"row {labels[ready[0][0]]}: {e}"))]
            return [r for item in ready for r in self._generate([item], labels)]
        return [(i, _result(out)) for (i, _, _), out in zip(ready, outs, strict=True)]


def _result(out: Any) -> dict[str, Any]:
    return {
        "text": out.text,
        "token_ids": np.asarray(out.token_ids, dtype=np.int64),
        "finish_reason": out.finish_reason,
        "num_cached_tokens": out.num_cached_tokens,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "error": None,
    }


def _failed(message: str) -> dict[str, Any]:
    return {
        "text": None,
        "token_ids": np.empty(0, dtype=np.int64),
        "finish_reason": "error",
        "num_cached_tokens": 0,
        "num_prompt_tokens": 0,
        "error": message,
    }


# -- row index and prefix keys ------------------------------------------------------------------
@ray.remote
def _block_rows(table: pa.Table) -> int:
    return table.num_rows


@ray.remote
def _with_row_index(table: pa.Table, start: int) -> pa.Table:
    return table.append_column(ROW, pa.array(np.arange(start, start + table.num_rows)))


def with_row_index(ds: ray.data.Dataset) -> ray.data.Dataset:
    """``ds`` with ``ROW``, each row's index in ``ds``'s block order (``ds`` is materialized)."""
    blocks = ds.to_arrow_refs()
    sizes = ray.get([_block_rows.remote(b) for b in blocks])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist() if sizes else []
    indexed = [_with_row_index.remote(b, s) for b, s in zip(blocks, starts, strict=True)]
    return ray.data.from_arrow_refs(indexed)


def _add_prefix_keys(
    table: pa.Table, tokenizer: TextTokenizer | None, block: int, page_size: int
) -> pa.Table:
    prompts = {f: table.column(f).to_pylist() for f in PROMPT_FIELDS if f in table.column_names}
    keys = []
    for i, label in enumerate(table.column(ROW).to_pylist()):
        row = {f: values[i] for f, values in prompts.items() if values[i] is not None}
        try:
            prompt = row_prompt(f"row {label}", row, tokenizer)
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) and tokenizer else prompt
            keys.append(prefix_key([int(t) for t in ids], block, page_size))
        except (ValueError, TypeError):
            keys.append(prefix_key([-1 - int(label)], block, page_size))  # a key of its own
    return table.append_column(KEY, pa.array(keys, type=pa.int64()))


def _add_position(table: pa.Table, position: np.ndarray) -> pa.Table:
    rows = table.column(ROW).to_numpy()
    return table.append_column(POSITION, pa.array(position[rows]))


def shard_by_prefix(
    indexed: ray.data.Dataset, engine_cfg: EngineConfig, opts: RaySection, replicas: int
) -> tuple[list[ray.data.MaterializedDataset], ShardPlan]:
    """Key every row of ``indexed`` (which carries ``ROW``) by its prompt prefix, plan the
    shards, and return one dataset per replica, each in its run order."""
    page_size = engine_cfg.kv_pool.page_size
    tokenizer = load_tokenizer(engine_cfg.model.path) if engine_cfg.model.path else None
    keyed = indexed.map_batches(
        _add_prefix_keys,
        batch_format="pyarrow",
        fn_kwargs={
            "tokenizer": tokenizer,
            "block": key_block(opts.prefix_tokens, page_size),
            "page_size": page_size,
        },
    ).materialize()
    rows, keys = [], []
    for batch in keyed.select_columns([ROW, KEY]).iter_batches(batch_format="numpy"):
        rows.append(batch[ROW])
        keys.append(batch[KEY])
    row_keys = np.empty(keyed.count(), dtype=np.int64)
    if rows:
        row_keys[np.concatenate(rows)] = np.concatenate(keys)
    plan = plan_shards(row_keys, replicas, opts.max_imbalance)
    ordered = (
        keyed.map_batches(
            _add_position, batch_format="pyarrow", fn_kwargs={"position": plan.position()}
        )
        .sort(POSITION)
        .materialize()
    )
    bounds = np.cumsum(plan.sizes)[:-1].tolist()
    return ordered.split_at_indices(bounds), plan


# -- the job ------------------------------------------------------------------------------------
def _replica_map(
    ds: ray.data.Dataset, engine_cfg: EngineConfig, opts: RaySection, size: int
) -> ray.data.Dataset:
    return ds.map_batches(
        EngineReplica,
        fn_constructor_kwargs={"config": engine_cfg},
        batch_size=opts.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=opts.num_cpus,
        num_gpus=opts.num_gpus,
        # A replica that dies is restarted (its engine rebuilt) and its batch run again; Ray
        # keeps one result per batch, so every row comes out exactly once.
        max_restarts=-1,
        max_task_retries=-1,
    )


def generate_rows(
    ds: ray.data.Dataset,
    config: str | Path | list[str | Path] | dict[str, Any] | None,
    overrides: list[str] | None,
    replicas: int,
) -> ray.data.Dataset:
    """``generate_dataset`` keeping ``ROW``, the input index of each output row."""
    if replicas < 1:
        raise ValueError(f"replicas: got {replicas}; expected an int >= 1")
    engine_cfg, opts = split_config(config, overrides)
    indexed = with_row_index(ds)
    if opts.prefix_affinity:
        shards, _ = shard_by_prefix(indexed, engine_cfg, opts, replicas)
        # One single-actor pool per shard pins each shard to its own replica.
        outs = [_replica_map(shard, engine_cfg, opts, 1) for shard in shards if shard.count()]
        out = outs[0].union(*outs[1:]) if len(outs) > 1 else outs[0]
    else:
        out = _replica_map(indexed, engine_cfg, opts, replicas)
    out = out.sort(ROW)
    out.context.execution_options.preserve_order = True
    return out


def generate_dataset(
    ds: ray.data.Dataset,
    config: str | Path | list[str | Path] | dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    replicas: int = 1,
) -> ray.data.Dataset:
    """``ds`` with the generation columns added, in input order, through ``replicas`` engines.

    ``config`` is YAML path(s) or a dict, possibly partial, merged over the defaults;
    ``overrides`` may mix engine keys (``kv_pool.page_size=16``) with ``ray.`` keys.
    """
    out = generate_rows(ds, config, overrides, replicas)
    return out.drop_columns([c for c in (ROW, KEY, POSITION) if c in out.columns()])


def init_ray(address: str | None) -> None:
    """Join ``address``, or start a local Ray; a running one is kept."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False if address is None else None)


def run_generate_ray(args: argparse.Namespace) -> int:
    """``hyloop generate --ray N``: the JSONL rows through N replicas, written in input order.
    Rows that fail are written with their ``error`` and named on stderr; the exit code is then
    1."""
    if args.ray < 1:
        raise ValueError(f"--ray: got {args.ray}; expected a number of replicas >= 1")
    if not args.input:
        raise ValueError("--ray needs --input, a JSONL of rows to generate from")
    numbered = read_jsonl(args.input)
    model = args.model or str(default_checkpoint())
    overrides = [*args.overrides, f"model.path={model}"]
    _, opts = split_config(args.config or None, overrides)
    init_ray(opts.address)
    ray.data.DataContext.get_current().enable_progress_bars = not args.no_progress
    ds = ray.data.from_items([row for _, row in numbered])
    out = generate_rows(ds, args.config or None, overrides, args.ray)
    results: list[dict[str, Any]] = [{} for _ in numbered]
    for row in out.select_columns([ROW, *OUTPUT_FIELDS]).iter_rows():
        results[row[ROW]] = {f: _cell(row[f]) for f in OUTPUT_FIELDS}
    failed = 0
    sink = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115
    try:
        for (n, row), result in zip(numbered, results, strict=True):
            if result["error"] is not None:
                failed += 1
                print(f"hyloop: error: {args.input}:{n}: {result['error']}", file=sys.stderr)
            rec = {**row, **{f: result[f] for f in ("text", "token_ids", "finish_reason")}}
            rec["num_cached_tokens"] = result["num_cached_tokens"]
            if result["error"] is not None:
                rec["error"] = result["error"]
            sink.write(json.dumps(rec) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    cached = sum(r["num_cached_tokens"] for r in results)
    prompt = sum(r["num_prompt_tokens"] for r in results)
    print(
        f"{len(results) - failed} rows done, {failed} failed; {args.ray} replicas "
        f"({'prefix affinity' if opts.prefix_affinity else 'default split'}); prefill "
        f"{prompt - cached} tokens computed, {cached} cached",
        file=sys.stderr,
    )
    return 1 if failed else 0
