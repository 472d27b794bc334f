"""``hyloop tts``: TTS requests in (JSONL), frames out (``.npy`` beside the output JSONL).

Each input line is one request: its prompt rows inline (``rows``: a list of ``[channels]`` int
lists) or as a path to an ``.npy`` file (``rows_npy``, relative to the JSONL), and ``TTSParams``
fields (``max_frames`` required; ``seed``, ``audio_temperature``, ...). Each output line keeps the
input fields and adds ``frames`` (the ``.npy`` file of the generated rows ``[n, channels]``,
beside the output), ``num_frames``, ``finish_reason`` and ``num_cached_rows``; input order kept.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from hyloop.recipes.offline import read_json_lines
from hyloop.tts import TTSEngine, TTSParams

ROW_FIELDS = ("rows", "rows_npy")  # a request gives exactly one


def load_requests(path: str) -> tuple[list[dict[str, Any]], list[np.ndarray], list[TTSParams]]:
    base = Path(path).parent
    records, prompts, params = [], [], []
    for n, row in read_json_lines(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        given = [f for f in ROW_FIELDS if f in row]
        if len(given) != 1:
            raise ValueError(f"{where}: give exactly one of `rows` or `rows_npy`, got {given}")
        if "rows" in row:
            try:
                rows = np.asarray(row["rows"], dtype=np.int64)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: rows: expected a list of int rows ({e})") from None
        else:
            npy = base / str(row["rows_npy"])
            if not npy.is_file():
                raise ValueError(f"{where}: rows_npy: no file {npy}")
            rows = np.load(npy)
        fields = {k: v for k, v in row.items() if k not in (*ROW_FIELDS, "id")}
        params.append(TTSParams.from_dict(fields, where))
        records.append(row)
        prompts.append(rows)
    return records, prompts, params


def run_tts(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model: a TTS checkpoint directory is required")
    if not args.input or not args.output:
        raise ValueError("--input and --output are required (JSONL in, JSONL out)")
    records, prompts, params = load_requests(args.input)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with TTSEngine(args.model, config=args.config or None, overrides=args.overrides) as tts:
        outs = tts.generate(prompts, params, use_tqdm=not args.no_progress)
        with open(out_path, "w") as fh:
            for i, (rec, out) in enumerate(zip(records, outs, strict=True)):
                frames = out_path.with_name(f"{out_path.stem}.{i}.npy")
                np.save(frames, out.rows)
                line = dict(rec)
                line.update(
                    frames=frames.name,
                    num_frames=len(out.rows),
                    finish_reason=out.finish_reason,
                    num_cached_rows=out.num_cached_rows,
                )
                fh.write(json.dumps(line) + "\n")
        if not args.no_progress:
            print(tts.summary())
    return 0
