"""``hyloop tts``: TTS requests in (JSONL), frames (``.npy``) and audio (``.wav``) out.

Each input line is one request, its prompt given one of two ways:

* ``text`` (what to say), with an optional voice reference ``voice`` (its codes, a list of
  ``[n_vq]`` int lists) or ``voice_npy`` (an ``.npy`` of them, relative to the JSONL), and the
  template's fields (``instruction``, ``tokens``, ``quality``, ``sound_event``,
  ``ambient_sound``, ``language``); the checkpoint's tokenizer builds the rows;
* prompt rows inline (``rows``: a list of ``[channels]`` int lists) or as ``rows_npy``;

plus ``TTSParams`` fields (``max_frames`` required; ``seed``, ``audio_temperature``, ...). Each
output line keeps the input fields and adds ``frames`` (the ``.npy`` of the generated rows
``[n, channels]``, beside the output), ``num_frames``, ``finish_reason``, ``num_cached_rows``,
and with ``--codec`` ``audio`` (a 16-bit ``.wav``), ``sample_rate``, ``time_to_first_audio_s``
and ``rtf``; input order kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from hyloop.recipes.offline import read_json_lines
from hyloop.tts import ToneCodec, TTSEngine, TTSParams, TTSPrompt, write_wav
from hyloop.tts.codec import Codec

ROW_FIELDS = ("rows", "rows_npy")
VOICE_FIELDS = ("voice", "voice_npy")
PROMPT_FIELDS = tuple(f.name for f in dataclasses.fields(TTSPrompt) if f.name != "voice")


def _ints(value: Any, where: str, what: str) -> np.ndarray:
    try:
        return np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {what}: expected a list of int rows ({e})") from None


def _npy(base: Path, name: Any, where: str, what: str) -> np.ndarray:
    path = base / str(name)
    if not path.is_file():
        raise ValueError(f"{where}: {what}: no file {path}")
    return np.load(path)


def _prompt(row: dict[str, Any], base: Path, where: str) -> tuple[Any, dict[str, Any]]:
    """(rows or a ``TTSPrompt``, the remaining fields: ``TTSParams``')."""
    rows_given = [f for f in ROW_FIELDS if f in row]
    if ("text" in row) == bool(rows_given) or len(rows_given) > 1:
        raise ValueError(f"{where}: give exactly one of `text`, `rows` or `rows_npy`")
    rest = {k: v for k, v in row.items() if k not in (*ROW_FIELDS, *VOICE_FIELDS, "id")}
    if rows_given:
        if any(f in row for f in VOICE_FIELDS):
            raise ValueError(f"{where}: `voice` goes with `text`, not with prompt rows")
        if "rows" in row:
            return _ints(row["rows"], where, "rows"), rest
        return _npy(base, row["rows_npy"], where, "rows_npy"), rest
    voices = [f for f in VOICE_FIELDS if f in row]
    if len(voices) > 1:
        raise ValueError(f"{where}: give at most one of `voice` or `voice_npy`")
    voice = None
    if voices == ["voice"]:
        voice = _ints(row["voice"], where, "voice")
    elif voices:
        voice = _npy(base, row["voice_npy"], where, "voice_npy")
    fields = {k: rest.pop(k) for k in PROMPT_FIELDS if k in rest}
    return TTSPrompt.from_fields(dict(fields, voice=voice), where), rest


def load_requests(path: str) -> tuple[list[dict[str, Any]], list[Any], list[TTSParams]]:
    base = Path(path).parent
    records, prompts, params = [], [], []
    for n, row in read_json_lines(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        prompt, fields = _prompt(row, base, where)
        params.append(TTSParams.from_dict(fields, where))
        records.append(row)
        prompts.append(prompt)
    return records, prompts, params


def load_codec(spec: str | None) -> Codec | None:
    """``tone`` (``ToneCodec``, 48 kHz) or ``package.module:factory`` (called with no
    arguments)."""
    if not spec:
        return None
    if spec == "tone":
        return ToneCodec()
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"--codec {spec!r}: expected 'tone' or module:factory")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--codec {spec!r}: {e}") from None
    return factory()


def run_tts(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model: a TTS checkpoint directory is required")
    if not args.input or not args.output:
        raise ValueError("--input and --output are required (JSONL in, JSONL out)")
    records, prompts, params = load_requests(args.input)
    codec = load_codec(getattr(args, "codec", None))
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cfg = args.config or None
    with TTSEngine(args.model, config=cfg, overrides=args.overrides, codec=codec) as tts:
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
                if out.audio is not None and out.sample_rate is not None:
                    wav = out_path.with_name(f"{out_path.stem}.{i}.wav")
                    write_wav(wav, out.audio, out.sample_rate)
                    m = out.metrics
                    line.update(
                        audio=wav.name,
                        sample_rate=out.sample_rate,
                        time_to_first_audio_s=m.time_to_first_audio_s if m else None,
                        rtf=m.rtf if m else None,
                    )
                fh.write(json.dumps(line) + "\n")
        if not args.no_progress:
            print(tts.summary())
    return 0
