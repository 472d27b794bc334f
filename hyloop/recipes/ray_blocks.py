"""The Arrow blocks of a Ray dataset on their way to hyloop replicas: each row's input index,
its request fields as plain Python, its prefix key, and a shuffle of rows into ordered parts.

Plain Ray tasks over the blocks: the driver holds a few ints per row (index, key, place), never
the rows themselves.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import ray.data

from hyloop.framework.sampling_params import SamplingParams
from hyloop.models.tokenizer import TextTokenizer
from hyloop.recipes.offline import PROMPT_FIELDS, SAMPLING_FIELDS, row_prompt
from hyloop.recipes.prefix_shards import prefix_key

ROW = "_hyloop_row"  # the row's index in the input dataset
REQUEST = "_hyloop_request"  # a row's request fields as one JSON object text (the CLI's rows)
WHERE = "_hyloop_where"  # what a row's error names it by (the CLI's ``file:line``)
INT_FIELDS = {  # the sampling fields that are ints (a numpy batch may hold them as floats)
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name in SAMPLING_FIELDS and str(f.type).split(" |")[0] == "int"
}
REQUEST_FIELDS = {*PROMPT_FIELDS, *SAMPLING_FIELDS}


def cell(value: Any) -> Any:
    """A batch cell as plain Python (numpy scalars and arrays unwrapped, NaN as missing)."""
    if isinstance(value, np.ndarray):
        return [cell(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: cell(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [cell(v) for v in value]
    return value


def batch_rows(columns: Mapping[str, Any], num_rows: int) -> list[dict[str, Any]]:
    """The prompt and sampling fields each row gives (missing ones left out), from the columns
    of a numpy batch or of an Arrow table (as lists); a ``REQUEST`` column, when there, holds
    them instead, as one JSON object text a row."""
    if REQUEST in columns:
        return [json.loads(text) for text in columns[REQUEST]]
    rows: list[dict[str, Any]] = [{} for _ in range(num_rows)]
    for f in (*PROMPT_FIELDS, *SAMPLING_FIELDS):
        if f not in columns:
            continue
        column = columns[f]
        # A nullable int column comes back as floats (NaN for missing): undo that, and only that.
        coerced = f in INT_FIELDS and getattr(column, "dtype", None) is not None
        coerced = coerced and column.dtype.kind == "f"
        for row, value in zip(rows, column, strict=True):
            value = cell(value)
            if value is None:
                continue
            if coerced and float(value).is_integer():
                value = int(value)
            row[f] = value
    return rows


@ray.remote
def _block_rows(table: pa.Table) -> int:
    return table.num_rows


@ray.remote
def _with_row_index(table: pa.Table, start: int) -> pa.Table:
    return table.append_column(ROW, pa.array(np.arange(start, start + table.num_rows)))


def indexed_blocks(ds: ray.data.Dataset) -> list[ray.ObjectRef]:
    """``ds``'s Arrow blocks, in its block order, with ``ROW``: each row's index in ``ds``."""
    blocks = ds.to_arrow_refs()
    sizes = ray.get([_block_rows.remote(b) for b in blocks])
    starts = np.cumsum([0, *sizes])[:-1].tolist()
    return [_with_row_index.remote(b, s) for b, s in zip(blocks, starts, strict=True)]


@ray.remote
def prefix_keys(
    table: pa.Table, tokenizer: TextTokenizer | None, block: int, page_size: int
) -> np.ndarray:
    """The key of each row of ``table``; a row whose prompt cannot be read gets a key of its
    own (it fails in its replica, naming itself)."""
    fields = [f for f in (REQUEST, *PROMPT_FIELDS) if f in table.column_names]
    rows = batch_rows({f: table.column(f).to_pylist() for f in fields}, table.num_rows)
    keys = np.empty(table.num_rows, dtype=np.int64)
    for i, (label, row) in enumerate(zip(table.column(ROW).to_pylist(), rows, strict=True)):
        try:
            prompt = row_prompt(f"row {label}", row, tokenizer)
            if isinstance(prompt, dict):  # a rendered chat
                prompt = prompt["prompt_token_ids"]
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) and tokenizer else prompt
            keys[i] = prefix_key([int(t) for t in ids], block, page_size)
        except (ValueError, TypeError):
            keys[i] = prefix_key([-1 - int(label)], block, page_size)
    return keys


@ray.remote
def _split_block(table: pa.Table, part_of: np.ndarray, parts: int) -> pa.Table | list[pa.Table]:
    """The block's rows of each part: ``parts`` returns (with one, Ray stores the return value
    itself as the one object, so that is the table, not a list holding it)."""
    part = part_of[table.column(ROW).to_numpy()]
    pieces = [table.filter(pa.array(part == p)) for p in range(parts)]
    return pieces[0] if parts == 1 else pieces


@ray.remote
def _gather(position: np.ndarray | None, chunks: int, *pieces: pa.Table) -> Any:
    """The part's pieces as ``chunks`` tables in run order (one: the table itself, as above)."""
    table = pa.concat_tables(pieces, promote_options="permissive")
    rows = table.column(ROW).to_numpy()
    table = table.take(pa.array(np.argsort(rows if position is None else position[rows])))
    if chunks == 1:
        return table
    bounds = np.linspace(0, table.num_rows, chunks + 1).astype(int)
    return [table.slice(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]


def regroup(
    blocks: list[ray.ObjectRef],
    part_of: np.ndarray,
    position: np.ndarray | None,
    chunks: list[int],
) -> list[list[ray.ObjectRef]]:
    """A shuffle of rows carrying ``ROW``: row ``i`` goes to part ``part_of[i]``, where rows
    run by ``position[i]`` (by ``i`` when None); part ``k`` comes as ``chunks[k]`` blocks."""
    parts = len(chunks)
    part_ref = ray.put(part_of)
    pos_ref = ray.put(position)
    pieces = [_split_block.options(num_returns=parts).remote(b, part_ref, parts) for b in blocks]
    if parts == 1:  # one return is a ref, not a list of them (the table, see _split_block)
        pieces = [[p] for p in pieces]
    out = []
    for k, n in enumerate(chunks):
        refs = _gather.options(num_returns=n).remote(pos_ref, n, *[p[k] for p in pieces])
        out.append([refs] if n == 1 else refs)
    return out
